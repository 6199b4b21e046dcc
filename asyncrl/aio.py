"""Small asyncio helpers."""

from __future__ import annotations

import asyncio


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
