"""One task group owning the producers, the engine watchdog (awaiting the engine's death) and the learner.

``await Pipeline(...).run(steps)`` returns a ``RunResult`` once the learner has taken ``steps`` optimiser steps
(``steps=None``: until the prompts run out and the queue is drained). An exception in any part cancels the
others and is re-raised; cancelling ``run()`` does the same. Either way the queue's receiving end is closed
(unused groups counted), a publication cut short has resumed the engine and left the versions in agreement,
and the engine is shut down (bounded by ``PipelineConfig.shutdown_timeout_s``) unless the caller owns it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.actors.learner import Learner
from asyncrl.actors.producer import Producer
from asyncrl.aio import bounded, first_cause
from asyncrl.config import PipelineConfig
from asyncrl.counters import GroupTotals
from asyncrl.errors import ConfigError
from asyncrl.engines.protocols import Lifecycle, WeightTarget
from asyncrl.errors import NoProgressError
from asyncrl.metrics import ProgressLine
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunResult:
    """What a run did. Times in seconds."""

    steps: int = 0  # optimiser steps taken
    version: int = 0  # final weight version (served by the engines)
    wall_s: float = 0.0
    groups_trained: int = 0
    samples_trained: int = 0
    tokens_generated: int = 0  # completion tokens in groups sent to the queue
    dropped: dict[str, int] = field(default_factory=dict)  # drop reason -> groups
    unaccounted: int = 0  # must be 0: queued groups neither trained nor dropped
    gen_s: float = 0.0  # synchronous mode: time spent generating
    train_s: float = 0.0  # time spent in optimiser steps (both modes)
    sync_s: float = 0.0  # time generation was paused for publications (both modes)
    sleep_s: float = 0.0  # synchronous mode with a sleeping engine: time putting it to sleep (waking is in sync_s)

    @property
    def samples_per_s(self) -> float:
        return self.samples_trained / self.wall_s if self.wall_s else 0.0


class Pipeline:
    """Wires producers -> queue -> learner -> (weights) -> engine, under one task group.

    Every producer's sink must be its own ``RolloutSender`` of the learner's queue (or a ``GroupSink`` wrapping
    one): the pipeline closes it (``aclose``) when that producer ends, and the queue ends once all of them
    have."""

    def __init__(self, engine: Lifecycle, producers: Sequence[Producer], learner: Learner,
                 config: PipelineConfig | None = None, *, close_engine: bool = True) -> None:
        if not producers:
            raise ValueError("Pipeline needs at least one producer")
        for p in producers:  # a group size the loss cannot learn from: refused here, not after a silent run
            n = p.config.sampling.n
            if n < learner.loss.min_group_size:
                raise ConfigError("SamplingConfig.n", f"{type(learner.loss).__name__} needs groups of at least "
                                                      f"{learner.loss.min_group_size} samples, {p.name} samples {n}")
        for p in producers:  # the learner's totals (metrics, checkpoints) include what the producers dropped
            learner.books.include(p.counters)
        # Each maker's gauges (episodes, judge, agents...) per learner step, once for the producers sharing it.
        for maker in {id(p.groups): p.groups for p in producers}.values():
            learner.hooks.append(lambda step, metrics, maker=maker: metrics.update(maker.metrics()))
        self.config = config or PipelineConfig()
        if self.config.progress:  # printed after every hook, those added later too: it sees what they add
            learner.progress = ProgressLine()
        self.engine = engine
        self.producers = list(producers)
        self.receiver = learner.receiver
        self.learner = learner
        self.close_engine = close_engine  # shut the engine down when run() ends
        self.result = RunResult()

    async def run(self, steps: int | None) -> RunResult:
        """Asynchronous mode: producers stream while the learner trains."""
        if steps is not None and steps <= 0:
            raise ValueError(f"steps must be positive (or None: until the data ends), got {steps}")
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [tg.create_task(self._produce(p), name=p.name) for p in self.producers]
                helpers.append(tg.create_task(self._watch_engine(), name="engine-watchdog"))
                await tg.create_task(self.learner.run(steps), name="learner")
                for task in helpers:  # the learner is done: everything else stops now
                    task.cancel()
        except BaseExceptionGroup as group:
            raise first_cause(group) from group
        finally:
            await self._shutdown(time.perf_counter() - t0)
        return self.result

    async def run_synchronous(self, steps: int) -> RunResult:
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
        return self.result

    async def _produce(self, producer: Producer) -> None:
        try:
            await producer.run()
        finally:  # this producer is done (or failed): the queue ends once every producer is
            await producer.sink.aclose()

    async def _sync_loop(self, producer: Producer, steps: int) -> None:
        size = self.learner.config.batch_groups
        while self.learner.step < steps:
            t_gen = time.perf_counter()
            batch = await self._generate_batch(producer, size)
            self.result.gen_s += time.perf_counter() - t_gen
            if not batch:
                raise NoProgressError(f"the prompts ran out after {self.learner.step} of {steps} steps (repeat "
                                      f"them with PromptSource(items, epochs=k), or epochs=None for no end); "
                                      f"group drops: {self.totals().describe_drops()}")
            sleeper = await self._sleep_engine()
            result = await self.learner.train_and_publish(batch, trim=sleeper is not None)
            await self.learner.flush()  # synchronous mode: the next batch is generated with these weights
            if sleeper is not None:  # a step that published nothing: wake with the weights it slept with
                await sleeper.wake()
            await self.learner.report(result)

    async def _sleep_engine(self) -> WeightTarget | None:
        """Nothing generates until the next publication: free the engine's memory for the learner step, if the
        weight target sleeps (``WeightTarget.sleep_level``). Level 2 keeps no weights, so a step that will not
        publish sleeps at level 1."""
        target = self.learner.weight_sync.target
        if not target.sleep_level:
            return None
        publishes = (self.learner.step + 1) % self.learner.config.sync.every == 0
        t0 = time.perf_counter()
        await target.sleep(None if publishes else 1)
        self.result.sleep_s += time.perf_counter() - t0
        return target

    async def _generate_batch(self, producer: Producer, size: int) -> list[RolloutGroup]:
        """Produce groups concurrently until ``size`` valid ones exist (drops are replaced)."""
        made = 0
        while made < size:
            items = [item for _ in range(size - made) if (item := await producer.prompts.next())]
            if not items:
                break
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(producer.produce_one(i, p)) for i, p in items]
            made += sum(t.result() is not None for t in tasks)
        # produce_one sent the groups into the queue; take them out so the books balance.
        return await self.receiver.receive_batch(made) if made else []

    async def _watch_engine(self) -> None:
        # The engine's own death event (``Lifecycle.wait_dead``): nothing here polls.
        raise await self.engine.wait_dead()

    async def _shutdown(self, wall_s: float) -> None:
        self.receiver.close()
        await bounded(self.learner.weight_sync.aclose(), self.config.shutdown_timeout_s, "a background publication")
        self._collect(wall_s)
        await bounded(self.learner.close(), self.config.shutdown_timeout_s, "the learner's thread")
        if self.close_engine:
            await bounded(self.engine.close(), self.config.shutdown_timeout_s, f"closing engine {self.engine.name}")

    def totals(self) -> GroupTotals:
        """The producers', queue's and learner's books added up (and a checkpoint's, when resumed)."""
        return self.learner.totals()

    def _collect(self, wall_s: float) -> None:
        totals = self.totals()
        r = self.result
        r.wall_s = wall_s
        r.steps = self.learner.step
        r.version = self.learner.version
        r.groups_trained = totals.trained
        r.samples_trained = totals.samples_trained
        r.tokens_generated = sum(p.counters.tokens for p in self.producers)
        r.dropped = {reason.value: c for reason, c in totals.dropped.items()}
        r.unaccounted = totals.unaccounted(self.receiver.depth)
        r.train_s = self.learner.train_s
        r.sync_s = self.learner.weight_sync.counters.paused_s
