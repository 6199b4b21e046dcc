"""The learner actor: batches of groups -> loss -> optimiser step -> (every ``sync.every`` steps) publish.

The forward/backward pass runs in the learner's own thread so the event loop keeps streaming rollouts while
the model trains (one thread: the same thread-local torch state every step, and a niceness that applies to
training alone). Versions belong to the ``VersionClock`` that its ``WeightSync`` commits to: ``version`` is the
one the engines serve, ``policy_version`` the one being trained (ahead while a publication is in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import Loss, SkipsInertGroups
from asyncrl.config import LearnerConfig
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.errors import EndOfRollouts, NoProgressError
from asyncrl.metrics import Monitor, NullMonitor
from asyncrl.queues.rollout_queue import RolloutReceiver
from asyncrl.types import DropReason, RolloutGroup, SyncTiming

log = logging.getLogger(__name__)

StepHook = Callable[[int, dict[str, float]], "Awaitable[None] | None"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int  # optimiser steps done so far (1-based after the first)
    metrics: Mapping[str, float]
    train_s: float  # forward + backward + optimiser step, seconds
    sync: SyncTiming | None  # the publication after this step, if one happened


class Learner:
    """Consumes the queue's receiving end, trains ``model`` with ``loss``, publishes through ``weight_sync``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Loss,
                 receiver: RolloutReceiver, weight_sync: WeightSync, config: LearnerConfig | None = None,
                 monitor: Monitor | None = None, step: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.receiver = receiver
        self.weight_sync = weight_sync
        self.config = config or LearnerConfig()
        self.monitor = monitor or NullMonitor()
        self.step = step  # optimiser steps taken
        self.samples_trained = 0  # rollouts that reached the loss
        self.train_s = 0.0  # total time in optimiser steps (seconds)
        self.hooks: list[StepHook] = []  # called after every step with (step, metrics); may add metrics
        self._publishing: asyncio.Task[SyncTiming] | None = None  # background publication (sync.overlap)
        # The training thread, made on first use. Dropping the learner lets its idle thread exit.
        self._thread: ThreadPoolExecutor | None = None

    @property
    def version(self) -> int:
        """The version the engines serve (the last publication that landed)."""
        return self.weight_sync.clock.served

    @property
    def policy_version(self) -> int:
        """The version of the weights being trained: ``version``, or the one being published in the
        background (``sync.overlap``). Staleness is measured against it."""
        return self.weight_sync.clock.policy

    async def run(self, steps: int | None) -> None:
        """Train until ``self.step == steps`` (None: until every producer is done and the queue is drained).
        The last publication has landed when this returns.

        Raises ``NoProgressError`` when the queue ends before ``steps``, or no batch comes for
        ``stall_timeout_s``."""
        try:
            while steps is None or self.step < steps:
                t0 = time.perf_counter()
                try:
                    batch = await self._next_batch(steps)
                except EndOfRollouts:
                    if steps is None:
                        break
                    raise NoProgressError(f"the rollout queue ended after {self.step} of {steps} steps: every "
                                          f"producer finished; group drops: "
                                          f"{self.receiver.counters.describe_drops()}") from None
                wait_s = time.perf_counter() - t0
                result = await self.train_and_publish(batch)
                await self.report(result, extra={"learner/wait_s": wait_s})
            await self.flush()
        finally:
            if self._publishing is not None:  # failing or cancelled: don't leave a publication running
                self._publishing.cancel()
                await asyncio.gather(self._publishing, return_exceptions=True)
                self._publishing = None

    async def _next_batch(self, steps: int | None) -> list[RolloutGroup]:
        limit = self.config.stall_timeout_s
        try:
            async with asyncio.timeout(None if math.isinf(limit) else limit):
                return await self.receiver.receive_batch(self.config.batch_groups)
        except TimeoutError:
            stats = self.receiver.statistics()
            raise NoProgressError(
                f"no batch of {self.config.batch_groups} groups for stall_timeout_s={limit}s after "
                f"{self.step} of {steps if steps is not None else 'all'} steps: queue depth {stats.depth}, "
                f"{stats.open_senders} producers open, group drops: {self.receiver.counters.describe_drops()}"
            ) from None

    async def train_and_publish(self, batch: Sequence[RolloutGroup]) -> StepResult:
        """One optimiser step on ``batch``, then a publication if this step is a sync step."""
        staleness = [g.staleness(self.policy_version) for g in batch]
        t0 = time.perf_counter()
        try:
            metrics = await self._in_thread(self._train_step, batch)
        except BaseException:
            self.receiver.counters.drop(DropReason.UNUSED_AT_SHUTDOWN, len(batch), queued=True)
            raise
        train_s = time.perf_counter() - t0
        self.step += 1
        self.train_s += train_s
        self.samples_trained += sum(len(g.rollouts) for g in batch)
        self.receiver.counters.trained += len(batch)
        metrics["rollout/staleness_batch_mean"] = sum(staleness) / len(staleness)
        metrics["rollout/staleness_batch_max"] = max(staleness)
        timing = None
        if self.step % self.config.sync.every == 0:
            timing = await (self._publish_in_background() if self.config.sync.overlap else self.publish())
        return StepResult(self.step, metrics, train_s, timing)

    async def publish(self, version: int | None = None) -> SyncTiming:
        """Publish the current weights (as ``version``, default the next one) and wait until they are served."""
        await self.flush()
        return await self.weight_sync.publish(state_dict_for_engine(self.model), version)

    async def flush(self) -> SyncTiming | None:
        """Wait for the background publication, if any; returns its timing (raises its error)."""
        task, self._publishing = self._publishing, None
        return await task if task is not None else None

    async def _publish_in_background(self) -> SyncTiming | None:
        # At most one publication in flight. The next optimiser step changes the parameters in place, so
        # the publication gets a snapshot. Returns the timing of the publication that finished meanwhile.
        previous = await self.flush()
        snapshot = await self._in_thread(_snapshot, self.model)  # a copy of every weight: off the event loop
        self._publishing = self.weight_sync.start(snapshot)
        return previous

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-learner",
                                              initializer=lower_thread_priority, initargs=(self.config.nice,))
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _train_step(self, batch: Sequence[RolloutGroup]) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Inert groups still count in the token normaliser, so the step equals one over the whole batch.
        total_tokens = sum(g.num_tokens for g in batch) or 1
        active = [g for g in batch if not self._inert(g)]
        sums: dict[str, float] = {}
        batch_loss = 0.0  # the loss of the whole batch, inert groups contributing 0
        for chunk in _chunks(active, self.config.micro_batch_rollouts) if active else []:
            with self._precision():
                out = self.loss.compute(self.model, chunk)
            # Weight each micro-batch by its share of tokens so the step matches one full-batch pass.
            weighted = out.loss * (out.num_tokens / total_tokens)
            weighted.backward()
            batch_loss += float(weighted.detach())
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(chunk) / len(active)
        sums["loss/total"] = batch_loss  # exact, where the per-chunk average would only approximate it
        if len(active) < len(batch):  # groups are skipped only without KL/entropy terms: policy == total
            sums["loss/policy"] = batch_loss
        if not active:  # a zero gradient, as scoring the batch would give: the optimiser still steps
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grad_norm = self._clip_and_step()
        sums.update(_batch_gauges(batch, active, sums))
        sums["train/grad_norm"] = grad_norm
        sums["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return sums

    def _precision(self) -> contextlib.AbstractContextManager[object]:
        if self.config.autocast is None:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=getattr(torch, self.config.autocast))

    def _inert(self, group: RolloutGroup) -> bool:
        return self.config.skip_inert_groups and isinstance(self.loss, SkipsInertGroups) and self.loss.inert(group)

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.config.max_grad_norm > 0 and params:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        if not torch.isfinite(torch.tensor(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {norm} at step {self.step + 1}; step skipped")
        self.optimizer.step()
        return norm

    async def report(self, result: StepResult, extra: Mapping[str, float] | None = None) -> None:
        """Add pipeline gauges to a step's metrics, run the hooks, and log to the monitor."""
        metrics = dict(result.metrics)
        metrics.update(extra or {})
        metrics["learner/version"] = self.version
        metrics["learner/train_s"] = result.train_s
        metrics.update(self.receiver.metrics())
        metrics.update(self.receiver.counters.metrics())
        metrics.update(self.weight_sync.metrics())
        for hook in self.hooks:
            maybe = hook(result.step, metrics)
            if asyncio.iscoroutine(maybe):
                await maybe
        self.monitor.log(result.step, metrics)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux: a thread id names just that thread)."""
    if nice:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state_dict_for_engine(model).items()}


def _batch_gauges(batch: Sequence[RolloutGroup], active: Sequence[RolloutGroup],
                  loss_metrics: Mapping[str, float]) -> dict[str, float]:
    """Reward and length gauges over the whole batch (the loss saw only the active groups)."""
    total = sum(len(g.rollouts) for g in batch)
    scored = sum(len(g.rollouts) for g in active)
    gauges = {
        "train/reward_mean": sum(r.reward for g in batch for r in g.rollouts) / total,
        "train/completion_len_mean": sum(len(r.sample.token_ids) for g in batch for r in g.rollouts) / total,
        "train/inert_groups_frac": 1 - len(active) / len(batch),
    }
    gauges["train/adv_abs_mean"] = loss_metrics.get("train/adv_abs_mean", 0.0) * scored / total  # inert: 0
    return gauges


def _chunks(batch: Sequence[RolloutGroup], max_rollouts: int) -> list[list[RolloutGroup]]:
    """Split whole groups into micro-batches of at most ``max_rollouts`` rollouts (at least one group)."""
    chunks: list[list[RolloutGroup]] = [[]]
    count = 0
    for group in batch:
        if chunks[-1] and count + len(group.rollouts) > max_rollouts:
            chunks.append([])
            count = 0
        chunks[-1].append(group)
        count += len(group.rollouts)
    return chunks
