"""The structured-concurrency helpers behind the cancellation guarantees."""

from __future__ import annotations

import asyncio

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
