"""The structured-concurrency helpers behind the cancellation guarantees."""

from __future__ import annotations

import asyncio
import inspect

import pytest


def test_a_cancelled_load_still_commits_or_restores():
    """The load and the version commit are one step: a cancellation during it waits for it, never splits it."""
    from asyncrl.aio import settle

    async def scenario() -> tuple[bool, int]:
        committed = []

        async def load() -> None:
            await asyncio.sleep(0.05)
            committed.append(1)

        task = asyncio.create_task(settle(load(), "load"))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True, len(committed)
        return False, len(committed)

    cancelled, commits = asyncio.run(scenario())
    assert cancelled and commits == 1


def test_settle_lets_the_error_through_when_not_cancelled():
    from asyncrl.aio import settle

    async def failing() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(settle(failing()))


def test_together_lets_the_callers_cancellation_through_a_child_that_fails_as_it_is_cancelled():
    """Python 3.11's TaskGroup raises a child's error in place of the caller's cancellation; ``together`` must not:
    a pairwise judge that raised while the pipeline was shutting down once let a producer slot run on, cancelled,
    and wait for ever for an admission ticket."""
    from asyncrl.aio import together

    async def fails_when_cancelled(started: asyncio.Event) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("judge service down")

    async def scenario() -> str:
        started = asyncio.Event()
        task = asyncio.create_task(together(fails_when_cancelled(started), fails_when_cancelled(asyncio.Event())))
        await started.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except RuntimeError:
            return "the child's error"
        return "finished"

    assert asyncio.run(scenario()) == "cancelled"


def test_together_raises_a_childs_error_as_itself_when_nobody_cancelled():
    from asyncrl.aio import together

    async def fails() -> None:
        raise RuntimeError("judge service down")

    with pytest.raises(RuntimeError, match="judge service down"):
        asyncio.run(together(fails(), asyncio.sleep(10)))


def test_together_cancelled_before_it_starts_closes_the_coroutines_it_was_given():
    from asyncrl.aio import together

    async def judge() -> float:
        return 1.0

    async def scenario() -> str:
        coro = judge()
        task = asyncio.create_task(together(coro))
        await asyncio.sleep(0)  # together has started its group's task, which has not run yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return inspect.getcoroutinestate(coro)

    assert asyncio.run(scenario()) == inspect.CORO_CLOSED


async def _owned_until_cancelled(started: asyncio.Event, cleaned: list[str], name: str) -> None:
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await asyncio.sleep(0)  # a clean-up that itself awaits: aclose must wait for it, not just cancel
        cleaned.append(name)
        raise


def test_a_task_owner_closed_while_its_tasks_run_cancels_and_awaits_them():
    from asyncrl.aio import TaskOwner

    async def scenario() -> None:
        cleaned: list[str] = []
        owner = TaskOwner("test")
        events = [asyncio.Event() for _ in range(3)]
        tasks = [owner.start(_owned_until_cancelled(e, cleaned, f"t{i}"), name=f"t{i}") for i, e in enumerate(events)]
        for e in events:
            await e.wait()
        assert len(owner) == 3
        await owner.aclose()
        assert sorted(cleaned) == ["t0", "t1", "t2"]  # each clean-up ran to its end before aclose returned
        assert all(t.cancelled() for t in tasks) and len(owner) == 0
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("t")]

        async with TaskOwner("scope") as scope:  # the same as a block: its end closes it
            started = asyncio.Event()
            inner = scope.start(_owned_until_cancelled(started, cleaned, "scoped"))
            await started.wait()
        assert inner.cancelled() and cleaned[-1] == "scoped"

    asyncio.run(scenario())


def test_a_failing_task_reaches_its_owner_and_its_awaiter_and_finished_tasks_are_forgotten():
    from asyncrl.aio import TaskOwner

    async def fail() -> None:
        raise ValueError("boom")

    async def fine() -> int:
        return 7

    async def scenario() -> None:
        told: list[BaseException] = []
        owner = TaskOwner("test", on_error=lambda _task, exc: told.append(exc))
        failing, ok = owner.start(fail()), owner.start(fine())
        ended = asyncio.Event()
        ok.add_done_callback(lambda _: ended.set())  # runs after the owner's own callback (registered first)
        with pytest.raises(ValueError, match="boom"):
            await failing
        assert await ok == 7
        await ended.wait()
        assert [str(e) for e in told] == ["boom"]  # the owner heard of the failure, not of the success
        assert len(owner) == 0  # ended tasks are not kept
        await owner.aclose()

    asyncio.run(scenario())


def test_task_owner_close_waits_for_its_tasks_when_its_caller_is_cancelled_and_is_bounded():
    from asyncrl.aio import TaskOwner

    order: list[str] = []

    async def stubborn(started: asyncio.Event, release: asyncio.Event) -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores cancellation until released
        order.append("released")

    async def scenario() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        owner = TaskOwner("test", timeout_s=60)
        task = owner.start(stubborn(started, release))
        await started.wait()
        closing = asyncio.create_task(owner.aclose())
        closing.add_done_callback(lambda _: order.append("closed"))
        await asyncio.sleep(0)
        closing.cancel()  # the closer is cancelled: it still waits for the task, then lets the cancellation through
        for _ in range(10):  # loop turns in which an unprotected close would have ended
            await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert task.done() and order == ["released", "closed"]

        started, release = asyncio.Event(), asyncio.Event()
        bounded_owner = TaskOwner("bounded", timeout_s=0.05)
        task = bounded_owner.start(stubborn(started, release))
        await started.wait()
        await bounded_owner.aclose()  # gives up after its bound: the task is still owned
        assert not task.done() and len(bounded_owner) == 1
        release.set()
        await task
        assert len(bounded_owner) == 0

    asyncio.run(scenario())


def test_a_race_lost_to_a_death_leaves_no_task_behind():
    from asyncrl.engines.death import Death
    from asyncrl.errors import EngineError

    async def scenario() -> None:
        death, started = Death(), asyncio.Event()
        before = asyncio.all_tasks()

        async def call() -> None:
            started.set()
            await asyncio.Event().wait()  # a dead engine never answers

        left: set[asyncio.Task] = set()

        async def racer() -> None:
            try:
                await death.race(call())
            finally:  # as the race returns: the call and the wait for the death are cancelled *and* awaited
                left.update(asyncio.all_tasks() - before - {asyncio.current_task()})

        racing = asyncio.create_task(racer())
        await started.wait()
        death.declare(EngineError("e", "gone"))
        with pytest.raises(EngineError, match="gone"):
            await racing
        assert left == set()

    asyncio.run(scenario())
