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
