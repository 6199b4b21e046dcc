"""The learner actor: batches of groups -> loss -> optimiser step -> (every ``sync.every`` steps) publish.

The forward/backward pass runs in the learner's own thread so the event loop keeps streaming rollouts while
the model trains (one thread: the same thread-local torch state every step, and a niceness that applies to
training alone). Versions belong to the ``VersionClock`` that its ``WeightSync`` commits to: ``version`` is the
one the engines serve, ``policy_version`` the one being trained (ahead while a publication is in flight).
The step itself runs on a ``TrainingBackend`` (``actors.training``): the single-device ``LocalBackend`` by
default, or a sharded one (``asyncrl.distributed.FSDPBackend``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from asyncrl.actors.probe import Expectation, PublicationProbe
from asyncrl.actors.training import LocalBackend, TrainingBackend
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.aio import TaskOwner
from asyncrl.algorithms.losses import Loss
from asyncrl.config import LearnerConfig
from asyncrl.counters import Books, Drops, GroupTotals
from asyncrl.engines.updates import WeightSource
from asyncrl.errors import EndOfRollouts, NoProgressError
from asyncrl.metrics import Monitor, NullMonitor
from asyncrl.queues.lengths import trained_gauges
from asyncrl.queues.rollout_queue import RolloutReceiver
from asyncrl.types import DropReason, RolloutGroup, SyncTiming

log = logging.getLogger(__name__)

StepHook = Callable[[int, dict[str, float]], "Awaitable[None] | None"]
T = TypeVar("T")


class StepRecorder(Protocol):
    """Told of every batch the learner trained, in order (the rollout log, ``asyncrl.rollout_log.RolloutLog``)."""

    async def record(self, step: int, policy_version: int, served_version: int, batch: Sequence[RolloutGroup],
                     metrics: Mapping[str, float], totals: GroupTotals) -> None:
        """After the optimiser step ``step`` trained ``batch`` at ``policy_version``, before its publication."""
        ...

    async def aclose(self) -> None:
        """The run is over (``Learner.close``): finish and release what it holds."""
        ...


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one optimiser step did (the environment's step result is ``asyncrl.StepResult``)."""

    step: int  # optimiser steps done so far (1-based after the first)
    metrics: Mapping[str, float]
    train_s: float  # forward + backward + optimiser step, seconds
    sync: SyncTiming | None  # the publication after this step, if one happened


@dataclass(slots=True)
class LearnerCounters:
    """A learner's books, written by it alone: groups handed to it either reach the loss or are dropped."""

    groups_trained: int = 0  # groups that reached the loss
    samples_trained: int = 0  # rollouts in those groups
    tokens_trained: int = 0  # completion (model) tokens of those rollouts
    dropped: Drops = field(default_factory=Drops)  # groups whose step failed or was cancelled, by reason


class Learner:
    """Consumes the queue's receiving end, trains ``model`` with ``loss``, publishes through ``weight_sync``.

    ``model``, ``optimizer`` and ``loss`` make the single-device ``LocalBackend``; to train on another
    backend pass it as ``backend`` and None for those three (they then read through to the backend's).

    The background publication of ``sync.overlap`` (and its probe) is a task of the learner's ``TaskOwner``:
    ``flush`` awaits it and raises its error; ``run`` ending and ``close`` cancel and await it."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, loss: Loss | None,
                 receiver: RolloutReceiver, weight_sync: WeightSync, config: LearnerConfig | None = None,
                 monitor: Monitor | None = None, step: int = 0, *, backend: TrainingBackend | None = None) -> None:
        config = config or LearnerConfig()
        if backend is None:
            if model is None or optimizer is None or loss is None:
                raise ValueError("Learner needs model, optimizer and loss, or a backend")
            backend = LocalBackend(model, optimizer, loss, config)
        elif any(x is not None for x in (model, optimizer, loss)):
            raise ValueError("pass model, optimizer and loss, or a backend that holds them, not both")
        self.backend = backend
        self.receiver = receiver
        self.weight_sync = weight_sync
        self.config = config
        self.monitor = monitor or NullMonitor()
        self.progress: Monitor | None = None  # a line per step for a person (PipelineConfig.progress), after the hooks
        self.step = step  # optimiser steps taken
        self.counters = LearnerCounters()
        # Its books, its queue's and (``books.include``) its producers': the totals it reports and checkpoints.
        self.books = Books(receiver.counters, self.counters)
        self.train_s = 0.0  # total time in optimiser steps (seconds)
        self.hooks: list[StepHook] = []  # called after every step with (step, metrics); may add metrics
        self.recorder: StepRecorder | None = None  # told of every trained batch (PipelineConfig.rollout_log)
        self._publishing: asyncio.Task[SyncTiming] | None = None  # background publication (sync.overlap)
        # Unbounded here: the pipeline bounds ``close`` with its ``shutdown_timeout_s``.
        self._tasks = TaskOwner("learner", timeout_s=math.inf)
        sync = weight_sync.config
        self.probe = None if sync.probe_tolerance is None else PublicationProbe(
            weight_sync.target, sync.probe_tolerance, sync.probe_tokens)
        # The training thread, made on first use; ``close`` lets it go (the pipeline does, as it shuts down).
        self._thread: ThreadPoolExecutor | None = None

    # The backend's parts, read and replaced through the learner (checkpoints and tests use them).
    model = property(lambda self: self.backend.model, lambda self, v: setattr(self.backend, "model", v))
    optimizer = property(lambda self: self.backend.optimizer, lambda self, v: setattr(self.backend, "optimizer", v))
    loss = property(lambda self: self.backend.loss, lambda self, v: setattr(self.backend, "loss", v))

    @property
    def version(self) -> int:
        """The version the engines serve (the last publication that landed)."""
        return self.weight_sync.clock.served

    @property
    def policy_version(self) -> int:
        """The version of the weights being trained: ``version``, or the one being published in the
        background (``sync.overlap``). Staleness is measured against it."""
        return self.weight_sync.clock.policy

    def totals(self) -> GroupTotals:
        """What ``books`` add up to now (``groups/*`` metrics, checkpoints, error messages)."""
        return self.books.totals()

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
                                          f"producer finished, so the prompts ran out (repeat them with "
                                          f"PromptSource(items, epochs=k), or epochs=None for no end); "
                                          f"group drops: {self.totals().describe_drops()}") from None
                wait_s = time.perf_counter() - t0
                result = await self.train_and_publish(batch)
                await self.report(result, extra={"learner/wait_s": wait_s})
            await self.flush()
        finally:
            self._publishing = None  # failing or cancelled: don't leave a publication running
            await self._tasks.aclose()

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
                f"{stats.open_senders} producers open, group drops: {self.totals().describe_drops()}"
            ) from None

    async def train_and_publish(self, batch: Sequence[RolloutGroup], *, trim: bool = False) -> StepReport:
        """One optimiser step on ``batch``, then a publication if this step is a sync step. ``trim``: hand the
        device memory the step left cached back first (the target sleeps, and the publication wakes it)."""
        policy_version = self.policy_version  # what the batch is trained at (a replay needs it)
        staleness = [g.staleness(policy_version) for g in batch]
        if self.probe is not None:
            self.probe.remember(batch)
        t0 = time.perf_counter()
        try:
            metrics = await self._in_thread(self._train_step, batch)
        except BaseException:
            self.counters.dropped.add(DropReason.UNUSED_AT_SHUTDOWN, len(batch))
            raise
        train_s = time.perf_counter() - t0
        self.step += 1
        self.train_s += train_s
        self.counters.groups_trained += len(batch)
        self.counters.samples_trained += sum(len(g.rollouts) for g in batch)
        metrics["rollout/staleness_batch_mean"] = sum(staleness) / len(staleness)
        metrics["rollout/staleness_batch_max"] = max(staleness)
        metrics.update(trained_gauges(batch, staleness, self.receiver.config.max_staleness))
        self.counters.tokens_trained += sum(g.num_tokens for g in batch)
        metrics["tokens/trained"] = self.counters.tokens_trained
        metrics["length/trained_mean_all"] = self.counters.tokens_trained / self.counters.samples_trained
        if self.recorder is not None:
            await self.recorder.record(self.step, policy_version, self.version, batch, metrics, self.totals())
        if trim:
            await self._in_thread(self.backend.trim)
        timing = None
        if self.step % self.config.sync.every == 0:
            timing = await (self._publish_in_background() if self.config.sync.overlap else self.publish())
        return StepReport(self.step, metrics, train_s, timing)

    async def publish(self, version: int | None = None) -> SyncTiming:
        """Publish the current weights (as ``version``, default the next one) and wait until they are served
        (and, with ``SyncConfig.probe_tolerance``, checked: ``PublicationMismatch`` otherwise)."""
        await self.flush()
        source, expected = await self._in_thread(self._taken, self.backend.publication_state)
        try:
            timing = await self.weight_sync.publish(source, version)
        finally:
            self.backend.release(source)
        await self._probed(timing.version, expected)
        return timing

    def _taken(self, take: Callable[[], WeightSource]) -> tuple[WeightSource, Expectation | None]:
        """In the training thread: the weights to publish, and the probe's expectation of exactly them."""
        source = take()
        try:
            return source, None if self.probe is None else self.probe.expect(self.backend.score)
        except BaseException:
            self.backend.release(source)
            raise

    async def _probed(self, version: int, expected: Expectation | None) -> None:
        if self.probe is not None:
            await self.probe.check(version, expected)

    async def _checked(self, publication: asyncio.Task[SyncTiming], expected: Expectation | None) -> SyncTiming:
        timing = await publication
        await self._probed(timing.version, expected)
        return timing

    async def flush(self) -> SyncTiming | None:
        """Wait for the background publication, if any; returns its timing (raises its error)."""
        task, self._publishing = self._publishing, None
        return await task if task is not None else None

    async def _publish_in_background(self) -> SyncTiming | None:
        # At most one publication in flight. The next optimiser step changes the parameters in place, so
        # the publication gets a snapshot. Returns the timing of the publication that finished meanwhile.
        previous = await self.flush()
        snapshot, expected = await self._in_thread(self._taken, self.backend.snapshot)  # a copy: off the loop
        try:
            started = self.weight_sync.start(snapshot)
        except BaseException:
            self.backend.release(snapshot)
            raise
        started.add_done_callback(lambda _: self.backend.release(snapshot))
        self._publishing = self._tasks.start(self._checked(started, expected), name="learner-publication")
        return previous

    async def close(self) -> None:
        """End the training thread once its work is over: waited for off the event loop, since a step that a
        cancellation cut short still runs to its end there, after the background publication is cancelled and
        awaited; then the recorder is closed. Training again makes a new thread."""
        self._publishing = None
        await self._tasks.aclose()
        thread, self._thread = self._thread, None
        try:
            if thread is not None:
                await asyncio.to_thread(thread.shutdown)
        finally:
            if self.recorder is not None:
                await self.recorder.aclose()

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-learner",
                                              initializer=lower_thread_priority, initargs=(self.config.nice,))
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _train_step(self, batch: Sequence[RolloutGroup]) -> dict[str, float]:
        return self.backend.train_step(batch, self.step)

    async def report(self, result: StepReport, extra: Mapping[str, float] | None = None) -> None:
        """Add pipeline gauges to a step's metrics, run the hooks, log to the monitor, print the progress line."""
        metrics = dict(result.metrics)
        metrics.update(extra or {})
        metrics["learner/version"] = self.version
        metrics["learner/train_s"] = result.train_s
        metrics.update(self.receiver.metrics())
        metrics.update(self.totals().metrics())
        metrics.update(self.weight_sync.metrics())
        metrics.update(self.probe.metrics() if self.probe is not None else {})
        for hook in self.hooks:
            maybe = hook(result.step, metrics)
            if asyncio.iscoroutine(maybe):
                await maybe
        self.monitor.log(result.step, metrics)
        if self.progress is not None:
            self.progress.log(result.step, metrics)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux: a thread id names just that thread)."""
    if nice:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
