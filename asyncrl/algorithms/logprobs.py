"""Score completions under a causal LM: per-token log-probs (and entropy) in one batched forward pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class CompletionLogprobs:
    """Per-token scores of ``B`` completions, right-padded to the longest completion ``T``."""

    logprobs: Tensor  # [B, T] float32 log-prob (nats) of each completion token under logits / T; 0 where masked
    entropy: Tensor | None  # [B, T] float32 entropy (nats) of the same tempered distribution; None unless asked
    mask: Tensor  # [B, T] float32: 1 for a completion token that is trained on, 0 for padding (and env tokens)


@dataclass(frozen=True, slots=True)
class _Batch:
    """Prompt + completion rows, right-padded so every row starts at position 0."""

    input_ids: Tensor  # [B, L] long, padded with ``pad_id``
    attention_mask: Tensor  # [B, L] long, 1 on real tokens
    position_ids: Tensor  # [B, L] long, 0..L-1 in every row (real tokens are left-aligned)
    score_at: Tensor  # [B, T] long: index whose logits predict each completion token (0 at padding)
    targets: Tensor  # [B, T] long: the completion tokens, padded with ``pad_id``
    mask: Tensor  # [B, T] float32, 1 for a real completion token


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    with_entropy: bool = False,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> CompletionLogprobs:
    """Log-prob of every completion token given its prompt and the completion tokens before it.

    ``loss_masks`` (one per row, None for a row whose tokens are all the model's) marks the tokens of
    multi-turn trajectories that are scored: environment tokens (0) are in the context of the tokens after them
    but get mask 0, log-prob 0 and entropy 0. Without it every completion token is scored, as before.

    ``model`` is any causal LM called as ``model(input_ids=, attention_mask=, position_ids=).logits``.
    Rows are right-padded, so causal attention never lets a real token see padding and each row's
    positions are the ones it would get alone: the result matches scoring every row on its own (up to
    float rounding). Logits are divided by ``temperature`` and normalised in float32, which is what the
    sampler's behaviour log-probs are measured under. Gradients flow unless the caller disables them.
    """
    _check_inputs(prompts, completions, temperature, loss_masks)
    batch = _right_padded(prompts, completions, pad_id, _device_of(model), loss_masks)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    rows = torch.arange(len(prompts), device=logits.device)[:, None]
    # Only the positions that predict completion tokens are normalised: [B, T, V], not [B, L, V].
    scored = torch.log_softmax(logits[rows, batch.score_at].float() / temperature, dim=-1)
    logprobs = scored.gather(-1, batch.targets[..., None]).squeeze(-1) * batch.mask
    entropy = -(scored.exp() * scored).sum(-1) * batch.mask if with_entropy else None
    return CompletionLogprobs(logprobs=logprobs, entropy=entropy, mask=batch.mask)


def _right_padded(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, device: torch.device,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> _Batch:
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    steps = max(len(c) for c in completions)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    score_at = torch.zeros((len(rows), steps), dtype=torch.long)
    targets = torch.full((len(rows), steps), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), steps), dtype=torch.float32)
    for i, (row, prompt, completion) in enumerate(zip(rows, prompts, completions)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
        n = len(completion)
        # logits at index t predict token t + 1, so completion token j is scored at len(prompt) + j - 1
        score_at[i, :n] = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        targets[i, :n] = torch.tensor(list(completion), dtype=torch.long)
        row_mask = loss_masks[i] if loss_masks is not None else None
        mask[i, :n] = 1.0 if row_mask is None else torch.tensor(list(row_mask), dtype=torch.float32)
    position_ids = torch.arange(width).expand(len(rows), width)
    return _Batch(*(t.to(device) for t in (input_ids, attention_mask, position_ids, score_at, targets, mask)))


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
