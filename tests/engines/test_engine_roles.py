"""The engine roles' optional behaviour, on fakes: sleep forwarded by the pool and the supervisor, and an
engine's death awaited as an event rather than polled. The real-engine versions are in
vllm_local/test_sleep_mode.py and vllm_local/test_faults_vllm.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.pool import EnginePool
from asyncrl.engines.protocols import EngineError
from asyncrl.engines.supervisor import SupervisedEngine
from tests.support.pipelines import config, make_pipeline, prompts

WAIT_S = 10.0


class SleepyFake(FakeEngine):
    """A fake that sleeps at level 1 and records the levels it was put to sleep at."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[int | None] = []
        self.woken = 0

    @property
    def sleep_level(self) -> int:
        return 1

    async def sleep(self, level: int | None = None) -> None:
        self.slept.append(level)

    async def wake(self) -> None:
        self.woken += 1


async def _never_restart() -> FakeEngine:
    raise AssertionError("the engine did not die: nothing to restart")


@pytest.mark.parametrize("wrapper", ["plain", "pool", "supervised"])
async def test_the_synchronous_pipeline_sleeps_an_engine_behind_any_wrapper(wrapper: str) -> None:
    """Before the wrappers forwarded sleep, a synchronous pipeline over them silently never slept."""
    engine = SleepyFake()
    target = {"plain": engine, "pool": EnginePool([engine]),
              "supervised": SupervisedEngine(engine, _never_restart)}[wrapper]
    assert target.sleep_level == 1
    pipe = make_pipeline(target, prompts(100), config(every=2))
    result = await asyncio.wait_for(pipe.run_synchronous(steps=3), WAIT_S)
    assert result.steps == 3
    assert engine.slept == [1, None, 1], "level 1 before a step that does not publish, the default otherwise"
    assert engine.woken == 3, "woken after every step (a no-op for an engine a publication woke)"


@pytest.mark.parametrize("sleeps", [True, False])
async def test_the_learner_trims_its_device_cache_before_a_sleeping_engine_wakes(sleeps: bool) -> None:
    """On a GPU the step's activations stay in the allocator's cache; an engine waking into that memory ran out
    of it (1.5B on an H200). The synchronous pipeline trims after the step, before the publication wakes it."""
    engine = SleepyFake() if sleeps else FakeEngine()
    events: list[str] = []
    load = engine.load

    async def recorded_load(update):  # type: ignore[no-untyped-def]
        events.append("load")
        await load(update)

    engine.load = recorded_load  # type: ignore[method-assign]
    pipe = make_pipeline(engine, prompts(100), config())
    pipe.learner.backend.trim = lambda: events.append("trim")  # type: ignore[method-assign]
    result = await asyncio.wait_for(pipe.run_synchronous(steps=3), WAIT_S)
    assert result.steps == 3
    assert events == (["trim", "load"] if sleeps else ["load"]) * 3


def test_an_engine_that_does_not_sleep_says_so_by_default() -> None:
    plain = FakeEngine()
    assert plain.sleep_level == 0 and EnginePool([plain]).sleep_level == 0


class CountedFake(FakeEngine):
    """Counts ``check_alive`` calls: the pipeline must not poll them."""

    def __init__(self) -> None:
        super().__init__(token_delay_s=0.001)
        self.probes = 0

    async def check_alive(self) -> None:
        self.probes += 1
        await super().check_alive()


@pytest.mark.parametrize("wrapper", ["plain", "pool", "supervised"])
async def test_a_dead_engine_ends_the_run_at_once_and_nothing_polls_it(wrapper: str) -> None:
    """The learner is held, so no generate or publication can notice the death: only the death event can.
    The run ends within a second, not after a health interval, and ``check_alive`` was never called (the
    watchdog used to call it every second)."""
    engine = CountedFake()
    target = {"plain": engine, "pool": EnginePool([engine]),
              "supervised": SupervisedEngine(engine, _never_restart, max_restarts=0)}[wrapper]
    pipe = make_pipeline(target, prompts(10_000), config(capacity=2, batch=2))
    reached, held = asyncio.Event(), asyncio.Event()

    async def hold(step: int, metrics: dict) -> None:
        reached.set()
        await held.wait()  # the learner stays here; producers block on the full queue

    pipe.learner.hooks.append(hold)
    run = asyncio.create_task(pipe.run(steps=100))
    await asyncio.wait_for(reached.wait(), WAIT_S)
    engine.alive = False
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="fake"):
        await asyncio.wait_for(run, WAIT_S)
    assert time.monotonic() - t0 < 1.0
    assert engine.probes == 0, "the pipeline polled the engine's health"
