"""The FSDP2 training backend: one model sharded over N ranks, a data-parallel step equal to the
single-process one.

``shard_model`` applies ``fully_shard`` to every transformer block, then to the root. Gradients are *summed*
over ranks (FSDP averages by default): each rank's micro-batch losses are already weighted by their share of
the whole batch's tokens, so the sum is the full-batch gradient, the same as ``LocalBackend`` computes.

Rank 0 is the ``TrainingBackend`` of the ``Learner``: each step it plans the batch (``partition``), sends every
rank its shard over the control channel and trains on its own. The other ranks run ``serve()``: a loop that
takes rank 0's commands (train a shard, gather for publication, save a checkpoint, stop) and joins the
collectives. Nothing else runs on them.

LoRA: ``shard_model(model, ctx, lora=LoraConfig(...))`` wraps the model with a PEFT adapter before sharding
(``asyncrl.distributed.lora``); the optimiser then holds the adapter alone, ``adapter_publication_state`` gathers
the adapter's full tensors, and sharded checkpoints store the adapter and its optimiser state alone.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.actors.probe import policy_logprobs
from asyncrl.actors.memory import memory_gauges, plan_memory, reset_peak
from asyncrl.actors.training import (accumulate, clip_and_step, enable_checkpointing, finish_metrics, is_inert,
                                     prepare_model, trim_device_cache, zero_grads)
from asyncrl.algorithms.losses import Loss
from asyncrl.config import LearnerConfig
from asyncrl.distributed.lora import check_optimizer, full_adapter_state, same_adapter
from asyncrl.distributed.partition import RankShard, plan_batch
from asyncrl.distributed.publication import DEFAULT_BUCKET_BYTES, full_buckets, stage_buckets
from asyncrl.distributed.ranks import ControlChannel, DistributedError, RankContext, guarded
from asyncrl.engines.updates import AdapterWeights, ShardedBuckets, UpdateKind, WeightSource
from asyncrl.engines.weights import StagedTensors
from asyncrl.lora.config import LoraConfig
from asyncrl.lora.model import adapter_config, apply_lora, is_lora
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # how long a stop waits for the step in progress before giving up on the followers


def shard_model(model: torch.nn.Module, ctx: RankContext, *, reshard_after_forward: bool = True,
                lora: LoraConfig | None = None) -> torch.nn.Module:
    """FSDP2 over ``ctx.mesh``: each decoder layer, then the root (embeddings, final norm, head). Moves the model
    to ``ctx.device`` first. Returns the same module, now sharded; with ``lora``, the model wrapped by
    ``asyncrl.lora.apply_lora`` first (the adapter rank 0 made, on every rank), sharded: train that one."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if lora is not None:
        model = apply_lora(model, lora)
    model.to(ctx.device)
    if lora is not None:
        same_adapter(model)
    for block in _blocks(model):
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=ctx.mesh)
    for module in model.modules():  # the settings are per FSDP module, not inherited
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the largest ``ModuleList`` (``model.layers`` in transformers' decoders)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to shard one by one")
    return list(max(lists, key=len))


@dataclass(frozen=True, slots=True)
class Gather:
    """Command: gather the full weights bucket by bucket (rank 0 stages them)."""

    bucket_bytes: int


@dataclass(frozen=True, slots=True)
class Call:
    """Command: every rank runs ``fn(backend)`` (a collective such as a sharded checkpoint save); ``fn`` must be
    importable by name (it is pickled)."""

    fn: Callable[[FSDPBackend], object]


@dataclass(frozen=True, slots=True)
class Stop:
    """Command: leave ``serve``. ``reason`` is logged; ``failed`` makes the followers raise it."""

    reason: str
    failed: bool = False


class FSDPBackend:
    """``TrainingBackend`` over an FSDP2-sharded model (``shard_model``), on every rank. For a LoRA model the
    optimiser must hold exactly the adapter's parameters (``ValueError`` otherwise)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Loss, config: LearnerConfig,
                 ctx: RankContext, *, publish_dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, staging_dir: str | Path | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.config = config
        self.ctx = ctx
        self.publish_dtype = publish_dtype or next(model.parameters()).dtype  # the engines' weight dtype
        self.bucket_bytes = bucket_bytes
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.channel = ControlChannel(ctx)
        self.stopped = False
        self._handed_out: dict[int, StagedTensors] = {}  # staged publications not released yet, by id
        # What a publication carries, declared once: a LoRA policy its adapter alone, any other every weight.
        self.publishes = UpdateKind.ADAPTER if is_lora(model) else UpdateKind.FULL
        if self.publishes is UpdateKind.ADAPTER:
            check_optimizer(model, optimizer)
        # This rank's memory plan (``LearnerConfig.memory_budget_gib``), over its shards: rank 0's sizes the passes.
        self.memory = plan_memory(model, optimizer, config) if config.memory_budget_gib is not None else None
        prepare_model(model, config)  # on every rank: a recomputed block gathers its shards again, a collective

    # -- rank 0: the learner's backend -------------------------------------------------------------------

    def train_step(self, batch: Sequence[RolloutGroup], step: int) -> dict[str, float]:
        def inert(group: RolloutGroup) -> bool:
            return is_inert(self.loss, self.config, group)

        if self.memory is not None:  # a group that fits no pass fails here, before any rank is told anything
            self.memory = self.memory.for_batch([g for g in batch if not inert(g)])
        memory = self.memory
        plan = plan_batch(batch, self.ctx.world_size, self.config.micro_batch_rollouts, step, inert,
                          max_tokens=self.config.micro_batch_tokens, split=memory.split if memory else None,
                          checkpointing=memory is not None and memory.checkpointing)
        with self._command():
            shard = self.channel.scatter(plan.shards)
            assert isinstance(shard, RankShard)
            batch_loss, sums, grad_norm = self._train_shard(shard)
        sums = finish_metrics(sums, batch_loss, batch, plan.active_groups, plan.scored_rollouts)
        sums["train/grad_norm"] = grad_norm
        sums["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if memory is not None:  # the largest pass of any rank; the peak measured on rank 0's device
            sums.update(memory_gauges(memory, [c.groups for s in plan.shards for c in s.chunks], self.model))
        return sums

    def publication_state(self) -> ShardedBuckets | AdapterWeights:
        """A LoRA policy publishes its adapter alone (``adapter_publication_state``); any other, every weight
        gathered bucket by bucket and staged by rank 0."""
        if self.publishes is UpdateKind.ADAPTER:
            return AdapterWeights(self.adapter_publication_state(), adapter_config(self.model))
        with self._command():
            self.channel.scatter([Gather(self.bucket_bytes)] * self.ctx.world_size)
            staged = guarded(self.ctx, "gathering weights", lambda: stage_buckets(
                full_buckets(self.model, self.bucket_bytes), self.publish_dtype, self.staging_dir))
        self._handed_out[id(staged.staged)] = staged
        return ShardedBuckets(staged)

    def adapter_publication_state(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter's full tensors (new CPU tensors in the training dtype, unaffected by later steps)
        under PEFT's adapter-file names, as ``asyncrl.lora.adapter_state`` names them on the unsharded model.
        Rank 0 calls it; the other ranks gather with it from ``serve`` (a collective). ``TypeError`` for a
        model without an adapter."""
        if self.publishes is not UpdateKind.ADAPTER:
            raise TypeError(f"adapter_publication_state needs a LoRA model (shard_model(..., lora=...)), got "
                            f"{type(self.model).__name__}")
        return self.call(_gather_adapter)  # type: ignore[return-value]

    def snapshot(self) -> ShardedBuckets | AdapterWeights:
        return self.publication_state()  # staged files and gathered adapters do not change with later steps

    def release(self, source: WeightSource) -> None:
        """Let go of a staging this backend handed out (every full publication is one; released once)."""
        if source.files is not None:  # an adapter is held in memory: nothing was staged for it
            self._handed_out.pop(id(source.files)).release()

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """Every rank runs the forward (a collective); rank 0's log-probs."""
        return self.call(functools.partial(_score, token_ids=tuple(token_ids)))  # type: ignore[return-value]

    def trim(self) -> None:
        """Every rank's cached device memory back to its device (an engine may share any rank's device)."""
        self.call(_trim)

    def call(self, fn: Callable[[FSDPBackend], object]) -> object:
        """Run ``fn(backend)`` on every rank (a module-level function); returns rank 0's result."""
        with self._command():
            self.channel.scatter([Call(fn)] * self.ctx.world_size)
            return fn(self)

    def stop(self, reason: str = "done", *, failed: bool = False) -> None:
        """Tell the followers to leave ``serve``. Waits up to ``STOP_TIMEOUT_S`` for a step in progress; a
        follower that is gone is only logged (the launcher sees its exit). Idempotent."""
        if self.stopped or not self.ctx.leader:
            return
        if not self.channel.lock.acquire(timeout=STOP_TIMEOUT_S):
            log.error("a step is still running after %.0fs; not stopping the other ranks", STOP_TIMEOUT_S)
            return
        try:
            self.stopped = True
            if self.ctx.world_size > 1:
                self.channel.scatter([Stop(reason, failed)] * self.ctx.world_size)
        except DistributedError as exc:
            log.warning("could not tell every rank to stop: %s", exc)
        finally:
            self.channel.lock.release()

    def _command(self) -> threading.Lock:
        if self.stopped:
            raise DistributedError("the distributed learner was stopped")
        return self.channel.lock

    # -- every rank --------------------------------------------------------------------------------------

    def _train_shard(self, shard: RankShard) -> tuple[float, dict[str, float], float]:
        def step() -> tuple[float, dict[str, float], float]:
            if shard.checkpointing:
                enable_checkpointing(self.model)
            if self.memory is not None:
                reset_peak(self.model)
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            batch_loss, sums = accumulate(self.model, self.loss, shard.chunks, total_tokens=shard.total_tokens,
                                          active_groups=max(1, shard.active_groups),
                                          config=self.config, grad_sync=self._grad_sync)
            if shard.active_groups == 0:
                zero_grads(self.model)
            keys = sorted(sums)  # the same on every rank: every rank scored at least one (maybe padding) chunk
            summed = self.channel.all_sum([batch_loss, *(sums[k] for k in keys)])
            norm = clip_and_step(self.model, self.optimizer, self.config.max_grad_norm, shard.step)
            return summed[0], dict(zip(keys, summed[1:], strict=True)), norm

        return guarded(self.ctx, f"step {shard.step + 1}", step)

    def _grad_sync(self, last: bool) -> None:
        """Gradients accumulate unsharded over a step's micro-batches and are reduce-scattered once, after the
        last backward: one reduction per step instead of one per micro-batch."""
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]  # an FSDPModule

    # -- ranks > 0 ---------------------------------------------------------------------------------------

    def serve(self) -> None:
        """A follower's loop: run rank 0's commands until it says stop. Raises ``DistributedError`` when rank 0
        stopped after a failure or can no longer be heard; any other error ends this rank (and so the run)."""
        if self.ctx.leader:
            raise RuntimeError("rank 0 leads; serve() is for the other ranks")
        while True:
            command = self.channel.receive()
            if isinstance(command, RankShard):
                self._train_shard(command)
            elif isinstance(command, Gather):
                buckets = full_buckets(self.model, command.bucket_bytes)
                guarded(self.ctx, "gathering weights", lambda b=buckets: _drain(b))
            elif isinstance(command, Call):
                command.fn(self)
            elif isinstance(command, Stop):
                log.info("rank %d stops: %s", self.ctx.rank, command.reason)
                if command.failed:
                    raise DistributedError(f"rank 0 stopped the run: {command.reason}")
                return
            else:
                raise DistributedError(f"rank {self.ctx.rank}: unknown command {command!r}")


def _drain(buckets: Iterator[object]) -> None:
    for _ in buckets:  # followers gather only to take part; rank 0 keeps the tensors
        pass


def _gather_adapter(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return guarded(backend.ctx, "gathering the adapter", lambda: full_adapter_state(backend.model))


def _score(backend: FSDPBackend, token_ids: tuple[int, ...]) -> list[float]:
    try:
        return policy_logprobs(backend.model, token_ids)
    finally:  # FSDP2 keeps the root's parameters gathered after a forward, for the backward that would follow
        backend.model.reshard()


def _trim(backend: FSDPBackend) -> None:
    trim_device_cache(backend.model)
