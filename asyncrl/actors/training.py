"""Training backends: where the learner's optimiser step runs, behind one narrow Protocol.

The ``Learner`` owns the loop (batches, versions, publications, hooks); a backend owns the model, the optimiser
and the step. ``LocalBackend`` trains on one device in this process. ``asyncrl.distributed.FSDPBackend``
trains an FSDP2-sharded model across ranks and gathers full tensors bucket by bucket for publication. Both
build a step from the same pieces here (``accumulate``, ``clip_and_step``, ``batch_gauges``), so a sharded
step is the single-device step split over ranks, not a second copy of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from asyncrl.actors.memory import MemoryPlan, forward_tokens, memory_gauges, plan_memory, reset_peak
from asyncrl.actors.probe import policy_logprobs
from asyncrl.algorithms import varlen
from asyncrl.algorithms.logprobs import ScoringOptions
from asyncrl.algorithms.losses import Loss
from asyncrl.config import ConfigError, LearnerConfig
from asyncrl.engines.updates import AdapterWeights, InMemory, WeightSource, model_source
from asyncrl.types import RolloutGroup

__all__ = ["Chunk", "LocalBackend", "TrainingBackend", "accumulate", "batch_gauges", "chunks", "clip_and_step",
           "compile_elementwise", "compile_layers", "enable_checkpointing", "forward_tokens", "is_inert",
           "micro_batches", "precision", "prepare_model", "trim_device_cache"]


@runtime_checkable
class TrainingBackend(Protocol):
    """What the learner trains through. Every method but ``release`` runs in the learner's training thread."""

    model: torch.nn.Module  # the module being trained (sharded for a distributed backend)
    optimizer: torch.optim.Optimizer
    loss: Loss

    def train_step(self, batch: Sequence[RolloutGroup], step: int) -> dict[str, float]:
        """One optimiser step over the whole ``batch``; ``step`` is the number of steps taken before it.
        Returns the step's ``loss/*`` and ``train/*`` gauges."""
        ...

    def publication_state(self) -> WeightSource:
        """What to publish: every weight in checkpoint format (no tied duplicates), or the adapter alone for a
        policy trained through LoRA. May share storage with the live parameters: the learner does not step until
        the publication that reads them is done."""
        ...

    def snapshot(self) -> WeightSource:
        """Like ``publication_state`` but unaffected by later steps (a background publication reads it)."""
        ...

    def release(self, source: WeightSource) -> None:
        """The publication of ``source`` (from either method above) is over: free what it holds."""
        ...

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """The policy's log-prob of every token after the first given those before it, at temperature 1 (the
        publication probe's learner side)."""
        ...

    def trim(self) -> None:
        """Hand the memory the device allocator keeps cached back to the device: the synchronous pipeline calls it
        after a step, before a sleeping engine wakes into that memory."""
        ...


@dataclass(frozen=True, slots=True)
class Chunk:
    """One micro-batch of whole groups and how it counts in the step."""

    groups: list[RolloutGroup]
    real: bool = True  # False: padding that keeps ranks in step (it runs, but contributes exactly nothing)


def precision(model: torch.nn.Module, autocast: str | None) -> contextlib.AbstractContextManager[object]:
    if autocast is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=getattr(torch, autocast))


def attention_kernels() -> contextlib.AbstractContextManager[object]:
    """SDPA without cuDNN: its kernels are built per input shape, and a learner's micro-batches rarely repeat
    a shape, so every call paid milliseconds of CPU (measured: 40% of a packed 0.5B step on an H200).
    Flash, then memory-efficient (masks), then the math kernel; the backward follows the forward's choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def is_inert(loss: Loss, config: LearnerConfig, group: RolloutGroup) -> bool:
    return config.skip_inert_groups and loss.inert(group)


def accumulate(model: torch.nn.Module, loss: Loss, parts: Sequence[Chunk], *, total_tokens: int,
               active_groups: int, config: LearnerConfig,
               grad_sync: Callable[[bool], None] | None = None) -> tuple[float, dict[str, float]]:
    """Forward and backward every chunk, each weighted by its share of ``total_tokens`` (the whole batch's,
    over every rank), so the summed gradient is that of one full-batch pass. Returns this caller's part of the
    batch loss and of the loss metrics (group-weighted over ``active_groups``); parts from several ranks add
    up to the batch's. ``config`` sets the precision (``autocast``) and how the loss scores: the
    ``ScoringOptions`` handed to ``Loss.compute`` (``packing``, ``score_from_logits``, the compiled head).
    ``grad_sync(last)`` runs before each backward: a sharded model reduces its gradients on the last one only."""
    batch_loss: Tensor | float = 0.0
    sums: dict[str, Tensor | float] = {}
    scoring = scoring_options(config)
    for i, chunk in enumerate(parts):
        if grad_sync is not None:
            grad_sync(i == len(parts) - 1)
        with attention_kernels():  # the backward too: gradient checkpointing recomputes the forward there
            with precision(model, config.autocast):
                out = loss.compute(model, chunk.groups, scoring=scoring)
            scale = out.num_tokens / total_tokens if chunk.real else 0.0
            weighted = out.loss * scale
            weighted.backward()
        batch_loss = batch_loss + weighted.detach()
        share = len(chunk.groups) / active_groups if chunk.real else 0.0
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + (v.detach() if isinstance(v, Tensor) else v) * share
    return read_all(batch_loss, sums)


def scoring_options(config: LearnerConfig) -> ScoringOptions:
    """How the learner's losses score (``Loss.compute(..., scoring=)``), from its config."""
    return ScoringOptions(packed=config.packing, from_logits=config.score_from_logits,
                          compiled_head=config.compiled)


def read_all(batch_loss: Tensor | float, sums: dict[str, Tensor | float]) -> tuple[float, dict[str, float]]:
    """Device values to floats in one transfer: each separate read stalls the host until the device catches
    up, and the device then idles while the host queues the next kernels."""
    on_device = {k: v for k, v in sums.items() if isinstance(v, Tensor)}
    values = [torch.as_tensor(batch_loss, dtype=torch.float32), *on_device.values()]
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    loss, *read = torch.stack([v.to(device=device, dtype=torch.float32).reshape(()) for v in values]).tolist()
    floats = dict(zip(on_device, read))
    return loss, {k: floats[k] if k in floats else float(v) for k, v in sums.items()}


def zero_grads(model: torch.nn.Module) -> None:
    """A zero gradient, as scoring an all-inert batch would give: the optimiser still steps."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                  step: int) -> float:
    """Clip by the global gradient norm and step. Sharded (DTensor) gradients get their norm over every rank,
    so all ranks clip by the same factor and agree on a non-finite norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm_t = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
    if hasattr(norm_t, "full_tensor"):  # a DTensor holding this rank's partial norm
        norm_t = norm_t.full_tensor()
    norm = float(norm_t)
    if not torch.isfinite(torch.tensor(norm)):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"non-finite gradient norm {norm} at step {step + 1}; step skipped")
    if max_grad_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm_t)
    optimizer.step()
    return norm


def finish_metrics(sums: dict[str, float], batch_loss: float, batch: Sequence[RolloutGroup], active: int,
                   scored_rollouts: int) -> dict[str, float]:
    sums["loss/total"] = batch_loss  # exact, where the per-chunk average would only approximate it
    if active < len(batch):  # groups are skipped only without KL/entropy terms: policy == total
        sums["loss/policy"] = batch_loss
    sums.update(batch_gauges(batch, active, scored_rollouts, sums))
    return sums


def batch_gauges(batch: Sequence[RolloutGroup], active: int, scored: int,
                 loss_metrics: Mapping[str, float]) -> dict[str, float]:
    """Reward and length gauges over the whole batch (the loss saw only ``active`` groups, ``scored``
    rollouts)."""
    total = sum(len(g.rollouts) for g in batch)
    gauges = {
        "train/reward_mean": sum(r.reward for g in batch for r in g.rollouts) / total,
        "train/completion_len_mean": sum(len(r.sample.token_ids) for g in batch for r in g.rollouts) / total,
        "train/inert_groups_frac": 1 - active / len(batch),
    }
    gauges["train/adv_abs_mean"] = loss_metrics.get("train/adv_abs_mean", 0.0) * scored / total  # inert: 0
    return gauges


def chunks(batch: Sequence[RolloutGroup], max_rollouts: int,
           max_tokens: int | None = None) -> list[list[RolloutGroup]]:
    """Split whole groups into micro-batches of at most ``max_rollouts`` rollouts or, when ``max_tokens`` is
    given, at most that many forward tokens (``forward_tokens``) instead. Each holds at least one group, so a
    group over the limit goes alone: groups are never split (the loss needs a whole group for its baseline)."""
    def size(group: RolloutGroup) -> int:
        return len(group.rollouts) if max_tokens is None else forward_tokens(group)

    limit = max_rollouts if max_tokens is None else max_tokens
    out: list[list[RolloutGroup]] = [[]]
    count = 0
    for group in batch:
        if out[-1] and count + size(group) > limit:
            out.append([])
            count = 0
        out[-1].append(group)
        count += size(group)
    return out


def micro_batches(active: Sequence[RolloutGroup], config: LearnerConfig,
                  memory: MemoryPlan | None) -> list[list[RolloutGroup]]:
    """The passes of a step: sized by the memory plan when there is one (``LearnerConfig.memory_budget_gib``;
    pass it ``for_batch`` first), else by ``chunks``."""
    if not active:
        return []
    if memory is not None:
        return memory.split(active)
    return chunks(active, config.micro_batch_rollouts, config.micro_batch_tokens)


def prepare_model(model: torch.nn.Module, config: LearnerConfig) -> None:
    """Apply the learner's model-level settings: variable-length attention for packed rows, compiled layers or
    compiled element-wise chains, and gradient checkpointing (activations of each block are dropped after the forward
    and recomputed in the backward, trading about a third more compute for memory)."""
    if config.varlen_attention:
        varlen.install(model)
    if config.compile_layers:
        compile_layers(model)
    elif config.compile_elementwise:
        compile_elementwise(model)
    if config.gradient_checkpointing:
        enable_checkpointing(model)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Turn on the model's gradient checkpointing (``LearnerConfig.gradient_checkpointing``, or a memory plan
    that needs it); nothing to do when it is on already."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ConfigError("LearnerConfig.gradient_checkpointing",
                          f"needs a model with gradient_checkpointing_enable() (a transformers model), "
                          f"got {type(model).__name__}")
    if getattr(model, "is_gradient_checkpointing", False):
        return
    # Non-reentrant: needs no input that requires grad, and recomputes correctly under FSDP2.
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_elementwise(model: torch.nn.Module) -> None:
    """Compile, in place, every module whose class is a decoder's MLP or RMSNorm (``FooMLP``, ``FooRMSNorm``):
    small graphs with no data-dependent control flow, so dynamic shapes compile once per module class. (The
    log-prob head's chunk maths is compiled through ``ScoringOptions.compiled_head``, set by ``accumulate``.)"""
    targets = [m for m in model.modules() if type(m).__name__.endswith(("MLP", "RMSNorm"))]
    if not targets:
        raise ConfigError("LearnerConfig.compile_elementwise",
                          f"found no *MLP or *RMSNorm module in {type(model).__name__}")
    for module in targets:
        module.compile(dynamic=True)


def compile_layers(model: torch.nn.Module) -> None:
    """Compile, in place, every decoder layer (``FooDecoderLayer``) and each RMSNorm outside them (the final
    norm). Layers share one class, so with dynamic shapes they share one compiled graph."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ConfigError("LearnerConfig.compile_layers", f"found no *DecoderLayer module in {type(model).__name__}")
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and id(m) not in inside]
    for module in [*layers, *norms]:
        module.compile(dynamic=True)


def trim_device_cache(model: torch.nn.Module) -> None:
    """Empty the CUDA caching allocator of ``model``'s device (activations of the last step stay cached there
    otherwise, and a waking engine runs out of memory); nothing to do on a CPU."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        torch.cuda.empty_cache()


class LocalBackend:
    """The model on one device in this process: the single-device step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Loss,
                 config: LearnerConfig) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.config = config
        # The memory plan (``LearnerConfig.memory_budget_gib``): a budget below the static bytes fails here.
        self.memory = plan_memory(model, optimizer, config) if config.memory_budget_gib is not None else None
        prepare_model(model, config)

    def train_step(self, batch: Sequence[RolloutGroup], step: int) -> dict[str, float]:
        cfg = self.config
        active = [g for g in batch if not is_inert(self.loss, cfg, g)]
        if self.memory is not None and active:  # a group that fits no pass fails here, before anything changes
            self.memory = self.memory.for_batch(active)
            if self.memory.checkpointing:
                enable_checkpointing(self.model)
            reset_peak(self.model)
        parts = [Chunk(c) for c in micro_batches(active, cfg, self.memory)]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Inert groups still count in the token normaliser, so the step equals one over the whole batch.
        total_tokens = sum(g.num_tokens for g in batch) or 1
        batch_loss, sums = accumulate(self.model, self.loss, parts, total_tokens=total_tokens,
                                      active_groups=len(active), config=cfg)
        if not active:
            zero_grads(self.model)
        grad_norm = clip_and_step(self.model, self.optimizer, cfg.max_grad_norm, step)
        sums = finish_metrics(sums, batch_loss, batch, len(active), sum(len(g.rollouts) for g in active))
        sums["train/grad_norm"] = grad_norm
        sums["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.memory is not None:
            sums.update(memory_gauges(self.memory, [c.groups for c in parts], self.model))
        return sums

    def publication_state(self) -> InMemory | AdapterWeights:
        return model_source(self.model)

    def snapshot(self) -> InMemory | AdapterWeights:
        source = model_source(self.model)
        return replace(source, tensors={k: v.detach().clone() for k, v in source.tensors.items()})

    def release(self, source: WeightSource) -> None:
        pass  # plain tensors: the garbage collector frees them

    def score(self, token_ids: Sequence[int]) -> list[float]:
        return policy_logprobs(self.model, token_ids)

    def trim(self) -> None:
        trim_device_cache(self.model)
