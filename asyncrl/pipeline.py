"""One task group owning producers, the engine watchdog and the learner.

``await Pipeline(...).run(steps)`` returns ``RunStats`` once the learner has taken ``steps`` optimiser
steps. An exception in any part cancels the others and is re-raised; cancelling ``run()`` does the same.
Either way the queue is closed (unused groups counted), the engine is resumed if a sync was cut short, and
the engine is shut down (bounded by ``PipelineConfig.shutdown_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.actors.learner import Learner
from asyncrl.aio import first_cause
from asyncrl.actors.producer import Producer
from asyncrl.config import PipelineConfig
from asyncrl.engines.base import Engine
from asyncrl.ledger import GroupLedger
from asyncrl.queues.rollout_queue import RolloutQueue
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunStats:
    """What a run did. Times in seconds."""

    steps: int = 0  # optimiser steps taken
    version: int = 0  # final weight version
    wall_s: float = 0.0
    groups_trained: int = 0
    samples_trained: int = 0
    tokens_generated: int = 0  # completion tokens in groups put into the queue
    dropped: dict[str, int] = field(default_factory=dict)  # drop reason -> groups
    unaccounted: int = 0  # must be 0: queued groups neither trained nor dropped
    gen_s: float = 0.0  # synchronous mode: time spent generating
    train_s: float = 0.0  # time spent in optimiser steps (both modes)
    sync_s: float = 0.0  # time spent publishing weights (both modes)

    @property
    def samples_per_s(self) -> float:
        return self.samples_trained / self.wall_s if self.wall_s else 0.0


class Pipeline:
    """Wires producers -> queue -> learner -> (weights) -> engine, under one task group."""

    def __init__(self, engine: Engine, producers: Sequence[Producer], queue: RolloutQueue, learner: Learner,
                 config: PipelineConfig | None = None, *, close_engine: bool = True,
                 health_interval_s: float = 1.0) -> None:
        if not producers:
            raise ValueError("Pipeline needs at least one producer")
        self.engine = engine
        self.producers = list(producers)
        self.queue = queue
        self.learner = learner
        self.config = config or PipelineConfig()
        self.close_engine = close_engine  # shut the engine down when run() ends
        self.health_interval_s = health_interval_s  # engine liveness check period
        self.stats = RunStats()

    async def run(self, steps: int) -> RunStats:
        """Asynchronous mode: producers stream while the learner trains."""
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                producers = [tg.create_task(p.run(), name=p.name) for p in self.producers]
                helpers = [*producers, tg.create_task(self._finish_when_done(producers), name="data-end"),
                           tg.create_task(self._watch_engine(), name="engine-watchdog")]
                await tg.create_task(self.learner.run(steps), name="learner")
                for task in helpers:  # the learner is done: everything else stops now
                    task.cancel()
        except BaseExceptionGroup as group:
            raise first_cause(group) from group
        finally:
            await self._shutdown(time.perf_counter() - t0)
        return self.stats

    async def run_synchronous(self, steps: int) -> RunStats:
        """Baseline mode: generate a batch, then train on it while generation is idle, then publish."""
        t0 = time.perf_counter()
        producer = self.producers[0]
        try:
            async with asyncio.TaskGroup() as tg:
                watchdog = tg.create_task(self._watch_engine(), name="engine-watchdog")
                await tg.create_task(self._sync_loop(producer, steps), name="sync-loop")
                watchdog.cancel()
        except BaseExceptionGroup as group:
            raise first_cause(group) from group
        finally:
            await self._shutdown(time.perf_counter() - t0)
        return self.stats

    async def _finish_when_done(self, producers: list[asyncio.Task[None]]) -> None:
        # When every producer has run out of prompts, let the learner drain the queue and stop.
        await asyncio.wait(producers)
        await self.queue.finish()

    async def _sync_loop(self, producer: Producer, steps: int) -> None:
        size = self.learner.config.batch_groups
        while self.learner.step < steps:
            t_gen = time.perf_counter()
            batch = await self._generate_batch(producer, size)
            self.stats.gen_s += time.perf_counter() - t_gen
            if not batch:
                raise RuntimeError("prompt source exhausted before the requested steps were taken")
            result = await self.learner.train_and_publish(batch)
            await self.learner.flush()  # synchronous mode: the next batch is generated with these weights
            await self.learner.report(result)

    async def _generate_batch(self, producer: Producer, size: int) -> list[RolloutGroup]:
        """Produce groups concurrently until ``size`` valid ones exist (drops are replaced)."""
        batch: list[RolloutGroup] = []
        while len(batch) < size:
            items = [item for _ in range(size - len(batch)) if (item := await producer.prompts.next())]
            if not items:
                break
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(producer.produce_one(i, p)) for i, p in items]
            batch.extend(g for t in tasks if (g := t.result()) is not None)
        # produce_one put the groups into the queue too; take them out so the books balance.
        return await self.queue.get_batch(len(batch), self.learner.policy_version) if batch else []

    async def _watch_engine(self) -> None:
        # Polling is the only signal from an engine process that dies silently.
        while True:
            await self.engine.check_alive()
            await asyncio.sleep(self.health_interval_s)

    async def _shutdown(self, wall_s: float) -> None:
        await asyncio.shield(self.queue.close())
        self._collect_stats(wall_s)
        if self.close_engine:
            try:
                async with asyncio.timeout(self.config.shutdown_timeout_s):
                    await asyncio.shield(self.engine.close())
            except TimeoutError:
                log.error("engine %s did not shut down within %.0fs", self.engine.name,
                          self.config.shutdown_timeout_s)

    def _collect_stats(self, wall_s: float) -> None:
        ledger = self._merged_ledger()
        s = self.stats
        s.wall_s = wall_s
        s.steps = self.learner.step
        s.version = self.learner.version
        s.groups_trained = ledger.trained
        s.samples_trained = self.learner.samples_trained
        s.tokens_generated = sum(p.stats.tokens for p in self.producers)
        s.dropped = {r.value: c for r, c in ledger.dropped.items()}
        s.unaccounted = self.queue.ledger.unaccounted(self.queue.depth)
        s.train_s = self.learner.train_s
        s.sync_s = self.learner.weight_sync.total_s

    def _merged_ledger(self) -> GroupLedger:
        merged = GroupLedger(queued=self.queue.ledger.queued, trained=self.queue.ledger.trained)
        merged.dropped.update(self.queue.ledger.dropped)
        for ledger in {id(p.ledger): p.ledger for p in self.producers}.values():
            if ledger is not self.queue.ledger:
                merged.dropped.update(ledger.dropped)
        return merged


