"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


def first_cause(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped the run (the task group also holds the cancellations it caused)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return leaves[0]


async def together(*aws: Awaitable[Any]) -> list[Any]:
    """Run the awaitables concurrently and return their results. The first failure cancels the rest and is
    raised as itself (callers catch specific errors, not exception groups)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(aw) for aw in aws]  # type: ignore[arg-type]
    except BaseExceptionGroup as group:
        raise first_cause(group) from group
    return [t.result() for t in tasks]
