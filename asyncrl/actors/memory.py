"""The learner's memory plan: what one step holds on its device, predicted from the model's shape, so that
micro-batches are sized by a budget in GiB (``LearnerConfig.memory_budget_gib``) rather than by a token count.

Counted, in bytes (``b_res``: the parameters' dtype, which the residual stream keeps; ``b_act``: the compute
dtype, autocast's where it is on):

- *static*: every weight and buffer; a gradient and the optimiser's states (AdamW and ``StochasticAdamW``: two)
  for each parameter the optimiser holds, in its dtype (LoRA: the adapter's alone). Sharded (FSDP2): this rank's
  shards, plus full unsharded gradients (they accumulate unsharded over a step's micro-batches) and the blocks FSDP
  gathers.
- *per decoder position*: what autograd keeps for the backward (``_layer_bytes``), in every layer, or under
  gradient checkpointing only each block's input plus one block recomputed at a time.
- *attention*: a masked sdpa call keeps its ``[rows, width, width]`` mask converted to the compute dtype, in
  every layer it keeps activations for; the CPU's varlen reference keeps each sequence's scores per head.
- *the log-prob head*: chunked (``algorithms.head``, the default for Llama/Mistral/Qwen): the scored positions'
  hidden states and one chunk's logits at a time; from ``model(...).logits``: the logits of every position and
  float32 copies of the scored ones, all at once.

The peak is static plus the larger of one pass's activations and the optimiser step's temporaries (torch's
optimisers: one trainable-sized copy; ``StochasticAdamW``: one chunk's float32 maths, ``temporary_bytes``). The
coefficients count what a transformers Llama/Qwen2 layer saves, were checked against the CPU allocator's peak
(tests/actors/test_memory.py; docs/ARCHITECTURE.md has the figures) and are rounded up: the plan errs high.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.actors.optimizer import StochasticAdamW
from asyncrl.algorithms.head import CHUNK_ELEMENTS, decoder_and_head
from asyncrl.algorithms.logprobs import width_multiple
from asyncrl.algorithms.rows import pack, round_up
from asyncrl.config import LearnerConfig
from asyncrl.errors import ConfigError, MemoryBudgetError
from asyncrl.lora.shared_base import LentParameter
from asyncrl.types import RolloutGroup

__all__ = ["GIB", "Layout", "MemoryPlan", "ModelShape", "Pass", "memory_gauges", "plan_memory", "reset_peak"]

GIB = 1 << 30
FIELD = "LearnerConfig.memory_budget_gib"


class Layout(enum.Enum):
    """How a pass lays out its sequences, as far as memory goes (``algorithms.rows``, ``algorithms.varlen``)."""

    PADDED = "padded"  # a row per sequence, as wide as the longest, with a padding mask
    PACKED = "packed"  # rows as wide as the longest sequence, block-diagonal masks
    VARLEN = "varlen"  # one row, a flash kernel: no mask, no scores kept
    VARLEN_REFERENCE = "varlen_reference"  # one row, causal sdpa per sequence (CPU, float32): scores per head


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A transformers decoder's dimensions (from its ``config``)."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_width: int  # key/value heads x head dimension

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        cfg = getattr(model, "config", None)
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
        values = [getattr(cfg, n, None) for n in names]
        if not all(isinstance(v, int) for v in values):
            raise ConfigError(FIELD, f"needs a transformers decoder whose config has {', '.join(names)}; "
                                     f"{type(model).__name__} has none")
        hidden, intermediate, layers, vocab, heads = values
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(hidden, intermediate, layers, vocab, heads, kv_heads * head_dim)


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward/backward pass as the plan counts it."""

    tokens: int  # decoder positions, padding included
    scored: int  # positions the vocabulary projection sees
    attention: int  # bytes of masks or scores one layer keeps (``Layout``)
    longest: int = 0  # the longest sequence, in tokens (for messages)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What a learner step may hold (``budget_bytes``) and what a pass of a given shape will, in bytes."""

    budget_bytes: int
    static_bytes: int  # weights, gradients, optimiser states (a rank's share, when sharded)
    step_bytes: int  # the optimiser step's temporaries (activations are gone by then)
    pass_bytes: int  # fixed per pass: weights autocast casts and caches for the forward
    token_bytes: int  # activations per decoder position, every layer kept
    checkpointed_token_bytes: int  # the same under gradient checkpointing: block inputs, one block recomputed
    layers: int
    layout: Layout
    mask_bytes: int  # bytes per element of a converted attention mask (the compute dtype)
    heads: int
    from_logits: bool  # the head scores from ``model(...).logits`` (else chunked from hidden states)
    logits_token_bytes: int  # from logits: full logits and their gradient, per decoder position (0 chunked)
    scored_bytes: int  # per scored position: float32 log-softmax copies, or the kept hidden state (chunked)
    chunk_row_bytes: int  # chunked: logits and float32 temporaries of one row of a chunk
    chunk_rows: int  # chunked: rows a chunk holds at most
    can_checkpoint: bool  # the model has ``gradient_checkpointing_enable`` (a transformers model)
    checkpointing: bool  # gradient checkpointing in this plan (the config's, or turned on by ``for_batch``)
    token_cap: int | None  # ``LearnerConfig.micro_batch_tokens``: an extra cap on a pass's forward tokens
    max_tokens: int  # the most forward tokens one pass may hold (unpadded, no mask) within the budget

    def activation_bytes(self, p: Pass, checkpointing: bool | None = None) -> int:
        """Bytes one pass adds on top of the static ones, at its peak."""
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        per_token = self.checkpointed_token_bytes if ckpt else self.token_bytes
        # Checkpointed, one layer's masks at a time are kept (the recomputed one); otherwise every layer's.
        attention = p.attention * (1 if ckpt else self.layers) + p.attention // max(1, self.mask_bytes) * 2
        if self.from_logits:
            head = p.tokens * self.logits_token_bytes + p.scored * self.scored_bytes
        else:
            head = p.scored * self.scored_bytes + min(p.scored, self.chunk_rows) * self.chunk_row_bytes
        return self.pass_bytes + p.tokens * per_token + attention + head

    def predicted_peak_bytes(self, tokens: int | Pass, checkpointing: bool | None = None) -> int:
        """The step's peak for a pass of ``tokens`` forward tokens (unpadded, no mask, all scored) or of a
        ``Pass``: static bytes plus the larger of the pass's activations and the optimiser's temporaries."""
        p = tokens if isinstance(tokens, Pass) else Pass(tokens, tokens, 0)
        return self.static_bytes + max(self.step_bytes, self.activation_bytes(p, checkpointing))

    def pass_of(self, groups: Sequence[RolloutGroup]) -> Pass:
        """How a pass over ``groups`` is laid out (``algorithms.rows``), in positions, scored rows and mask."""
        seqs = [(len(g.prompt.token_ids), len(r.sample.token_ids)) for g in groups for r in g.rollouts]
        lengths = [p + c for p, c in seqs]
        longest, total = max(lengths), sum(lengths)
        scored = len(seqs) * max(c for _, c in seqs) if self.from_logits else sum(c for _, c in seqs)
        if self.layout is Layout.VARLEN:
            return Pass(round_up(total, width_multiple(total)), scored, 0, longest)
        if self.layout is Layout.VARLEN_REFERENCE:  # float32 scores [heads, n, n] of each sequence
            return Pass(round_up(total, width_multiple(total)), scored, 4 * self.heads * sum(n * n for n in lengths),
                        longest)
        if self.layout is Layout.PADDED:  # transformers drops the mask when nothing is padded
            rows, masked = len(lengths), min(lengths) < longest
        else:  # ... and when no row holds two sequences
            rows = 1 + max(r for r, _ in pack(lengths, longest))
            masked = rows < len(lengths)
        return Pass(rows * longest, scored, rows * longest * longest * self.mask_bytes * masked, longest)

    def fits(self, groups: Sequence[RolloutGroup], checkpointing: bool | None = None) -> bool:
        p = self.pass_of(groups)
        within_cap = self.token_cap is None or sum(forward_tokens(g) for g in groups) <= self.token_cap
        return within_cap and self.predicted_peak_bytes(p, checkpointing) <= self.budget_bytes

    def for_batch(self, groups: Sequence[RolloutGroup]) -> MemoryPlan:
        """This plan for a batch: gradient checkpointing on if the batch's largest group needs it to fit (or the
        config asks for it). ``MemoryBudgetError`` names a group that fits in no pass."""
        ckpt = self.checkpointing or any(not self._alone_fits(g, False) for g in groups)
        for g in groups:
            if not self._alone_fits(g, ckpt and self.can_checkpoint):
                raise self._too_large(g)
        return self if ckpt == self.checkpointing else _with_max_tokens(dataclasses.replace(self, checkpointing=ckpt))

    def split(self, groups: Sequence[RolloutGroup]) -> list[list[RolloutGroup]]:
        """Whole groups into passes, in order, each as large as the budget (and the token cap) allows. A group
        alone always makes a pass: ``for_batch`` has checked that it fits."""
        out, start = [], 0
        while start < len(groups):
            size = self._largest_fit(groups[start:])
            out.append(list(groups[start:start + size]))
            start += size
        return out

    def _largest_fit(self, groups: Sequence[RolloutGroup]) -> int:
        """How many of ``groups``, from the first, one pass holds (at least one): doubling, then bisecting, so no
        probe holds more than twice the answer (a probe lays the groups out: ``pass_of``)."""
        good, bad = 1, 2
        while bad <= len(groups) and self.fits(groups[:bad]):
            good, bad = bad, 2 * bad
        bad = min(bad, len(groups) + 1)
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if self.fits(groups[:mid]) else (good, mid)
        return good

    def _alone_fits(self, group: RolloutGroup, checkpointing: bool) -> bool:
        return self.predicted_peak_bytes(self.pass_of([group]), checkpointing) <= self.budget_bytes

    def _too_large(self, group: RolloutGroup) -> MemoryBudgetError:
        p = self.pass_of([group])
        ckpt = self.can_checkpoint
        need = self.predicted_peak_bytes(p, ckpt)
        how = "even with gradient checkpointing" if ckpt else "(this model cannot checkpoint its blocks)"
        return MemoryBudgetError(
            group.group_id, forward_tokens(group), need, self.budget_bytes,
            f"group {group.group_id!r} has {forward_tokens(group)} forward tokens ({len(group.rollouts)} rollouts, the "
            f"longest {p.longest}): one pass over it needs {need / GIB:.4g} GiB {how} ({self.static_bytes / GIB:.4g} "
            f"GiB static + {(need - self.static_bytes) / GIB:.4g} GiB for the pass), over the budget of "
            f"{self.budget_bytes / GIB:.4g} GiB")


def reset_peak(model: torch.nn.Module) -> None:
    """Start measuring a step's peak: CUDA's peak-allocation counter of ``model``'s device (nothing on a CPU)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_gauges(plan: MemoryPlan, passes: Sequence[Sequence[RolloutGroup]],
                  model: torch.nn.Module) -> dict[str, float]:
    """``learner/memory_predicted_gib``, the plan's peak for the step's largest pass (or the optimiser step's,
    for a step with no pass), and on a GPU ``learner/memory_peak_gib``, what was allocated at most since
    ``reset_peak``."""
    predicted = max((plan.predicted_peak_bytes(plan.pass_of(p)) for p in passes if p),
                    default=plan.static_bytes + plan.step_bytes)
    gauges = {"learner/memory_predicted_gib": predicted / GIB}
    device = next(model.parameters()).device
    if device.type == "cuda":
        gauges["learner/memory_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return gauges


def forward_tokens(group: RolloutGroup) -> int:
    """Tokens a group puts through the forward pass: its prompt once per rollout, plus every completion."""
    return sum(len(group.prompt.token_ids) + len(r.sample.token_ids) for r in group.rollouts)


def plan_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: LearnerConfig, *,
                optimizer_states: int | None = None) -> MemoryPlan:
    """The plan for ``model`` trained by ``optimizer`` under ``config``, whose ``memory_budget_gib`` is set.
    ``optimizer_states``: tensors the optimiser keeps per trainable parameter, when not the usual (AdamW 2, SGD
    with momentum 1). ``ConfigError`` when the static bytes alone exceed the budget, naming both."""
    if config.memory_budget_gib is None:
        raise ValueError("plan_memory needs LearnerConfig.memory_budget_gib")
    shape = ModelShape.of(model)
    res = _param_dtype(model).itemsize
    act = getattr(torch, config.autocast.value).itemsize if config.autocast is not None else res
    static, trainable, cached = _static_bytes(model, optimizer, shape, optimizer_states, act if act != res else 0)
    # torch's optimisers keep temporaries the size of what they update; StochasticAdamW works chunk by chunk.
    step = optimizer.temporary_bytes() if isinstance(optimizer, StochasticAdamW) else trainable
    budget = int(config.memory_budget_gib * GIB)
    if static >= budget:
        raise ConfigError(FIELD, f"{config.memory_budget_gib:.4g} GiB ({budget} bytes) is below the "
                                 f"{static / GIB:.4g} GiB ({static} bytes) that weights, gradients and optimiser "
                                 f"states take alone")
    layer = _layer_bytes(shape, res, act)
    # Around the layers, per position: embeddings out, the final norm's float32 internals, the last hidden
    # state; int64 inputs (ids, positions, mask) and the backward's gradient of the residual stream.
    outside = shape.hidden * (3 * res + 8) + 64
    # Checkpointed, a block keeps only its input (h in the residual dtype). Measured per layer on the CPU: 4.1h
    # to 5.5h bytes in float32, growing a little with kv and i, hence the kv and i/8 terms.
    kept = (shape.hidden + shape.kv_width) * res + shape.intermediate * act // 8
    from_logits = config.score_from_logits or decoder_and_head(model) is None
    plan = MemoryPlan(
        budget_bytes=budget, static_bytes=static, step_bytes=step, pass_bytes=cached,
        # Half a layer more in both: the gradients of the block being backpropagated; checkpointed, that block's
        # activations too, recomputed.
        token_bytes=shape.layers * layer + layer // 2 + outside,
        checkpointed_token_bytes=shape.layers * kept + layer + layer // 2 + outside,
        layers=shape.layers, layout=_layout(model, config, act), mask_bytes=act, heads=shape.heads,
        from_logits=from_logits,
        # From logits: the [positions, vocab] logits and, in the backward, their gradient, in the compute dtype;
        # per scored position five float32 copies (cast, tempered, log-softmax, its exponential for the entropy,
        # the gradient): measured 12.7 to 21.5 bytes per vocabulary entry with and without an entropy term.
        # Chunked, the scored positions' hidden states are kept. Either way the loss's [rows, tokens] tensors.
        logits_token_bytes=2 * act * shape.vocab if from_logits else 0,
        scored_bytes=20 * shape.vocab + 128 if from_logits else shape.hidden * res + 128,
        # Chunked: one chunk's logits and their float32 temporaries at a time, at most four float32-sized copies
        # (measured 7.5 to 13.7 bytes per entry, the most with an entropy term).
        chunk_row_bytes=16 * shape.vocab, chunk_rows=max(1, CHUNK_ELEMENTS // shape.vocab),
        can_checkpoint=callable(getattr(model, "gradient_checkpointing_enable", None)),
        checkpointing=config.gradient_checkpointing, token_cap=config.micro_batch_tokens, max_tokens=0)
    return _with_max_tokens(plan)


def _layer_bytes(s: ModelShape, res: int, act: int) -> int:
    """Bytes one decoder layer keeps per position for its backward, counted on transformers' Llama/Qwen2 layer:
    the residual-stream tensors (norm inputs and outputs, q and its rotary form, the attention output) are 6
    copies in the residual dtype plus the two RMSNorms' float32 internals (8 bytes); k and v 2 copies (rotary
    keeps k in float32 under autocast); the MLP's gate, up, activation and product 4 in the compute dtype.
    On the CPU (bytes per position per layer, over h, kv, i): float32 32, 8, 16; bfloat16 20, 4, 8; float32
    under bfloat16 autocast 32, 5, 8.4 (so 8i comes out 5% low there: the margins elsewhere cover it)."""
    return s.hidden * (6 * res + 8) + s.kv_width * 2 * res + s.intermediate * 4 * act


def _with_max_tokens(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` with ``max_tokens``: the largest unpadded, unmasked pass within the budget (bisection)."""
    lo, hi = 0, max(1, plan.budget_bytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if plan.predicted_peak_bytes(mid) <= plan.budget_bytes else (lo, mid - 1)
    return dataclasses.replace(plan, max_tokens=lo if plan.token_cap is None else min(lo, plan.token_cap))


def _static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shape: ModelShape,
                  states: int | None, cast_bytes: int) -> tuple[int, int, int]:
    """(static bytes, trainable bytes, autocast's cached weight copies). Sharded parameters (DTensors) count
    this rank's shard; their gradients accumulate unsharded, and FSDP gathers two blocks and the root whole."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad and id(p) in held]
    # A lent base's memory is the engine's (``asyncrl.lora.share_base``): not the learner's to plan.
    weights = sum(_local_bytes(t) for t in [*model.parameters(), *model.buffers()] if not isinstance(t, LentParameter))
    per_param = 1 + (_optimizer_states(optimizer) if states is None else states)  # a gradient + the states
    static = weights + per_param * sum(_local_bytes(p) for p in trainable)
    if any(_local_bytes(p) != _bytes(p) for p in model.parameters()):  # sharded
        full = sum(_bytes(p) for p in model.parameters())
        itemsize = _param_dtype(model).itemsize
        block = itemsize * (2 * shape.hidden * (shape.hidden + shape.kv_width) + 3 * shape.hidden * shape.intermediate)
        static += sum(_bytes(p) for p in trainable) + 2 * block + max(0, full - shape.layers * block)
    # Autocast casts each trainable matrix once per forward and keeps the copy until the forward ends.
    cached = cast_bytes * sum(p.numel() for p in trainable if p.dim() >= 2)
    return static, sum(_local_bytes(p) for p in trainable), cached


def _optimizer_states(optimizer: torch.optim.Optimizer) -> int:
    """Tensors of a parameter's size the optimiser keeps per parameter: Adam and AdamW 2 (3 with amsgrad),
    ``StochasticAdamW`` 2, SGD 1 with momentum (else 0); any other is taken to keep 2."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, StochasticAdamW):
        return 2
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum") else 0
    return 2


def _layout(model: torch.nn.Module, config: LearnerConfig, act: int) -> Layout:
    if not config.packing:
        return Layout.PADDED
    if not config.varlen_attention:
        return Layout.PACKED
    on_gpu = next(model.parameters()).device.type == "cuda"
    return Layout.VARLEN if on_gpu and act == 2 else Layout.VARLEN_REFERENCE  # flash: bf16/fp16 on a GPU


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The widest floating-point parameter dtype (what the residual stream and gradients are kept in)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: d.itemsize, default=torch.float32)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local_bytes(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard
    return _bytes(local() if callable(local) else t)
