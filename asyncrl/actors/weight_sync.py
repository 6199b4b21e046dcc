"""Publishing the learner's weights into a weight target: lock -> prepare -> pause -> load -> resume.

The guarantees, whatever happens and whenever the caller is cancelled:

- resume always runs after a pause was asked for, and ``publish`` returns (or raises) only once it has, so a
  failed or cancelled publication never leaves generation paused;
- the load and the version commit form one uncancellable step: a cancellation that arrives during the load
  waits for it (milliseconds to a second), so the ``VersionClock`` and the engine never disagree;
- a cancellation is always re-raised as ``CancelledError``, never wrapped; whether the cut-short publication
  landed anyway (a cancellation that arrived during the load) is in ``WeightSync.outcome``, and it is counted
  as published or failed accordingly.

Preparing (validation and staging) and a ``wait`` pause stay cancellable: nothing is applied yet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncrl.aio import TaskOwner, settle
from asyncrl.config import SyncConfig
from asyncrl.engines.protocols import WeightTarget, WeightUpdate
from asyncrl.engines.updates import WeightSource, as_source
from asyncrl.types import PauseMode, SyncTiming
from asyncrl.versions import VersionClock

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SyncCounters:
    published: int = 0  # publications that landed (the target serves their version), cancelled ones included
    failures: int = 0  # publications that failed or were cancelled before their load committed
    paused_s: float = 0.0  # total time generation was paused for the ones that returned (seconds)


@dataclass(frozen=True, slots=True)
class PublicationOutcome:
    """How a publication ended. ``landed``: its load committed, so the target and the clock serve ``version``;
    that holds for a publication whose caller was cancelled during the load, as well as for one that
    returned. ``error``: what it raised (``CancelledError`` included), None when it returned."""

    version: int
    landed: bool
    error: BaseException | None = None


class WeightSync:
    """Serialises publications to one weight target (an engine or an ``EnginePool``) and owns the version
    commit on the ``VersionClock``. Background publications (``start``) are owned by its ``TaskOwner``:
    ``aclose`` cancels and awaits them (the pipeline calls it as it shuts down)."""

    def __init__(self, target: WeightTarget, clock: VersionClock, config: SyncConfig) -> None:
        self.target = target
        self.clock = clock
        self.config = config
        self._lock = asyncio.Lock()
        self.history: deque[SyncTiming] = deque(maxlen=1000)  # recent successful publications
        self.counters = SyncCounters()
        self.outcome: PublicationOutcome | None = None  # of the last publication that ended
        self._started = TaskOwner("weight-sync")  # background publications; their errors go to their awaiters

    async def publish(self, weights: WeightSource | Mapping[str, torch.Tensor], version: int | None = None
                      ) -> SyncTiming:
        """Make ``weights`` (a typed source, or checkpoint-format tensors in memory) the target's weights as
        ``version`` (default: the served version + 1), after any publication in flight. Raises
        ``WeightUpdateError`` (nothing applied), ``EngineError``, or ``CancelledError``."""
        async with self._lock:
            version = self.clock.served + 1 if version is None else version
            self.clock.begin(version)
            return await self._begun(WeightUpdate(version, as_source(weights)))

    def start(self, weights: WeightSource | Mapping[str, torch.Tensor]) -> asyncio.Task[SyncTiming]:
        """Begin publishing the next version in the background and return its task. The clock's policy version
        moves now, not when the task first runs, so staleness is judged against these weights at once.
        Raises ``RuntimeError`` if a publication is in flight."""
        if self._lock.locked() or self.clock.pending is not None:
            raise RuntimeError("a publication is already in flight; await it first")
        update = WeightUpdate(self.clock.served + 1, as_source(weights))
        self.clock.begin(update.version)

        async def run() -> SyncTiming:
            async with self._lock:
                return await self._begun(update)

        task = self._started.start(run(), name=f"publish-v{update.version}")
        task.add_done_callback(lambda _: self.clock.abandon(update.version))  # cancelled before it ran
        return task

    async def aclose(self) -> None:
        """Cancel the background publications still running and wait for them (each resumes the target and
        lands or not, as ``outcome`` then says). Their errors belong to whoever awaits their task."""
        await self._started.aclose()

    async def _begun(self, update: WeightUpdate) -> SyncTiming:
        try:
            timing = await self._publish(update)
        except BaseException as exc:
            landed = self.clock.served == update.version  # committed before the failure or cancellation
            self.outcome = PublicationOutcome(update.version, landed, exc)
            if landed:
                self.counters.published += 1
                log.info("v%d landed, then its publication raised %r", update.version, exc)
            else:
                self.counters.failures += 1
            raise
        finally:
            self.clock.abandon(update.version)  # no-op once committed
        self.outcome = PublicationOutcome(update.version, True)
        self.history.append(timing)
        self.counters.published += 1
        self.counters.paused_s += timing.total_s
        log.info("published v%d: pause %.3fs transfer %.3fs resume %.3fs", update.version, timing.pause_s,
                 timing.transfer_s, timing.resume_s)
        return timing

    async def _publish(self, update: WeightUpdate) -> SyncTiming:
        mode, clear = self.config.mode, self.config.clear_cache
        t_prep = time.perf_counter()
        update = await self.target.prepare(update)
        try:
            t0 = time.perf_counter()
            try:
                await self.target.pause(mode, clear)
            except BaseException:  # the pause may have taken effect before it was cut short
                await settle(self.target.resume(), "resume after a failed pause")
                raise
            t1 = time.perf_counter()
            try:
                await settle(self._load(update), f"loading version {update.version}")
            finally:
                t2 = time.perf_counter()
                await settle(self.target.resume(), "resume after loading")
            t3 = time.perf_counter()
        finally:
            self.target.release(update)
        return SyncTiming(version=update.version, pause_s=t1 - t0, transfer_s=t2 - t1, resume_s=t3 - t2,
                          total_s=t3 - t0, mode=mode, clear_cache=clear, prepare_s=t0 - t_prep)

    async def _load(self, update: WeightUpdate) -> None:
        await self.target.load(update)
        self.clock.commit(update.version)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        out: dict[str, float] = {"sync/count": c.published, "sync/failures": c.failures}
        if self.history:
            last = self.history[-1]
            out.update({"sync/pause_s": last.pause_s, "sync/transfer_s": last.transfer_s,
                        "sync/prepare_s": last.prepare_s, "sync/resume_s": last.resume_s,
                        "sync/total_s": last.total_s})
        return out


async def publish(target: WeightTarget, weights: torch.nn.Module | WeightSource | Mapping[str, torch.Tensor], *,
                  mode: PauseMode = PauseMode.KEEP, clear_cache: bool = True) -> int:
    """Publish ``weights`` (a transformers model, a typed source, or checkpoint-format tensors) into an engine
    driven by hand, outside a pipeline, in one call; returns the new version, the target's version + 1. A model
    trained through LoRA publishes its adapter alone (``model_source``).

    A ``WeightSync`` of its own does it, with the same guarantees: prepare, pause, load, resume (always), release;
    a cancellation waits for a load under way and comes through as ``CancelledError``. Raises
    ``WeightUpdateError`` (nothing applied) or ``EngineError``. One publication at a time per target: callers
    that publish concurrently share one ``WeightSync`` instead."""
    sync = WeightSync(target, VersionClock(target.version), SyncConfig(mode=mode, clear_cache=clear_cache))
    return (await sync.publish(as_source(weights))).version
