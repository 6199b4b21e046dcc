"""Score completions under a causal LM: per-token log-probs (and entropy) in one batched forward pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algorithms.head import chosen_logprobs, decoder_and_head
from asyncrl.algorithms.rows import Rows, packed_rows, padded_rows
from asyncrl.algorithms.varlen import SEGMENTS_KWARG, Segments
from asyncrl.algorithms.varlen import active as varlen_active


@dataclass(frozen=True, slots=True)
class ScoringOptions:
    """How ``completion_logprobs`` lays out and scores its rows; the values, not the maths (each way gives the
    same log-probs up to float rounding). The learner builds one from its ``LearnerConfig`` and hands it to
    ``Loss.compute``, which passes it on to every scoring call (its reference's too); the defaults are the
    plain way, for any other caller."""

    packed: bool = False  # several sequences per row (``algorithms.rows``; ``LearnerConfig.packing``)
    # Score from ``model(...).logits`` even where the decoder and head could be driven apart
    # (``LearnerConfig.score_from_logits``): for a forward that does more than its head shows, or comparisons.
    from_logits: bool = False
    # The log-prob head's chunk maths fused by ``torch.compile`` (``LearnerConfig.compiled``).
    compiled_head: bool = False


PLAIN = ScoringOptions()  # the default: padded rows, the head driven where it can be, nothing compiled


@dataclass(frozen=True, slots=True)
class CompletionLogprobs:
    """Per-token scores of ``B`` completions, right-padded to the longest completion ``T``."""

    logprobs: Tensor  # [B, T] float32 log-prob (nats) of each completion token under logits / T; 0 where masked
    entropy: Tensor | None  # [B, T] float32 entropy (nats) of the same tempered distribution; None unless asked
    mask: Tensor  # [B, T] float32: 1 for a completion token that is trained on, 0 for padding (and env tokens)
    num_scored: int  # tokens with mask 1 (counted on the host, so reading it never waits for the device)


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    with_entropy: bool = False,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
    packed: bool | None = None,
    scoring: ScoringOptions = PLAIN,
) -> CompletionLogprobs:
    """Log-prob of every completion token given its prompt and the completion tokens before it.

    ``loss_masks`` (one per row, None for a row whose tokens are all the model's) marks the tokens of
    multi-turn trajectories that are scored: environment tokens (0) are in the context of the tokens after them
    but get mask 0, log-prob 0 and entropy 0. Without it every completion token is scored, as before.

    ``model`` is any causal LM called as ``model(input_ids=, attention_mask=, position_ids=).logits``. A
    transformers Llama, Mistral or Qwen decoder that is not sharded is instead run up to its last hidden states,
    and only the scored positions go through the vocabulary projection, chunk by chunk
    (``asyncrl.algorithms.head``): same values up to float rounding, a fraction of the memory and time.
    Rows are right-padded, so causal attention never lets a real token see padding and each row's
    positions are the ones it would get alone: the result matches scoring every row on its own (up to
    float rounding). Logits are divided by ``temperature`` and normalised in float32, which is what the
    sampler's behaviour log-probs are measured under. Gradients flow unless the caller disables them.

    ``scoring`` says how (``ScoringOptions``, from the learner's config when a loss is called by the learner);
    ``packed`` (None: as ``scoring.packed`` says) overrides its choice of layout. Packed lays several sequences
    into one row instead (``asyncrl.algorithms.rows``) and calls ``model(input_ids=, position_ids=,
    use_cache=False)``: the model must then keep sequences apart by their restarting positions, as
    transformers' decoders do. The
    result has the same shape and, up to float rounding, the same values. A model switched to variable-length
    attention (``algorithms.varlen.install``) gets the whole call as one row plus where each sequence starts.
    """
    _check_inputs(prompts, completions, temperature, loss_masks)
    pack = scoring.packed if packed is None else packed
    device = _device_of(model)
    if pack and varlen_active(model):  # no quadratic cost in the row width: one row holds the micro-batch
        total = sum(len(p) + len(c) for p, c in zip(prompts, completions))
        batch = packed_rows(prompts, completions, pad_id, device, loss_masks, row_tokens=math.inf,
                            width_multiple=width_multiple(total))
    else:
        batch = (packed_rows if pack else padded_rows)(prompts, completions, pad_id, device, loss_masks)
    parts = None if scoring.from_logits else decoder_and_head(model)
    if parts is not None:
        logprobs, entropy = _from_hidden(*parts, batch, temperature, with_entropy, scoring.compiled_head)
    else:
        logprobs, entropy = _from_logits(model, batch, temperature, with_entropy)
    return CompletionLogprobs(logprobs=logprobs, entropy=entropy, mask=batch.mask, num_scored=len(batch.scored))


def width_multiple(tokens: int) -> int:
    """What a one-row micro-batch of ``tokens`` is padded up to a multiple of: the largest power of two at most
    ``tokens / 64`` (so under 1.6% padding). Token counts change every step, and each new matmul shape costs
    cuBLAS a kernel search on the host, an order of magnitude longer than a launch of a shape seen before
    (bench/gpu/host_probe.py), which left the device waiting; rounded widths recur within a few steps."""
    return 1 << max(0, (tokens // 64).bit_length() - 1)


def _model_inputs(model: torch.nn.Module, batch: Rows) -> dict[str, object]:
    if batch.packed and varlen_active(model):
        return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False,
                SEGMENTS_KWARG: Segments.from_lengths(batch.segments, batch.input_ids.device)}
    if batch.packed:  # no 2D mask and no cache: what makes transformers derive the mask from position_ids
        return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids}


def _from_logits(model: torch.nn.Module, batch: Rows, temperature: float,
                 with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    logits = model(**_model_inputs(model, batch)).logits
    # Only the positions that predict completion tokens are normalised: [B, T, V], not [rows, L, V].
    scored = torch.log_softmax(logits[batch.row_of[:, None], batch.score_at].float() / temperature, dim=-1)
    logprobs = scored.gather(-1, batch.targets[..., None]).squeeze(-1) * batch.mask
    entropy = -(scored.exp() * scored).sum(-1) * batch.mask if with_entropy else None
    return logprobs, entropy


def _from_hidden(decoder: torch.nn.Module, head: torch.nn.Linear, batch: Rows, temperature: float,
                 with_entropy: bool, compiled: bool) -> tuple[Tensor, Tensor | None]:
    inputs = {**_model_inputs(decoder, batch), "use_cache": False}
    hidden = decoder(**inputs).last_hidden_state
    chosen = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.hidden_at)
    targets = batch.targets.flatten().index_select(0, batch.scored)
    lp, ent = chosen_logprobs(chosen, head.weight, targets, temperature, with_entropy, compiled)

    def spread(values: Tensor) -> Tensor:  # [M] back onto the [N, T] grid, 0 where nothing is scored
        return torch.zeros(batch.mask.numel(), dtype=values.dtype, device=values.device).index_copy(
            0, batch.scored, values).view_as(batch.mask)

    return spread(lp), (spread(ent) if ent is not None else None)


def _check_inputs(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], temperature: float,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if loss_masks is not None:
        if len(loss_masks) != len(completions):
            raise ValueError(f"{len(loss_masks)} loss masks but {len(completions)} completions")
        for i, (m, c) in enumerate(zip(loss_masks, completions)):
            if m is not None and len(m) != len(c):
                raise ValueError(f"loss mask {i} has {len(m)} entries for a completion of {len(c)} tokens")
    if not prompts:
        raise ValueError("nothing to score: no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token to predict the first completion token from")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
