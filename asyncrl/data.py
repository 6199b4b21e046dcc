"""Prompt sources shared by producers, with a cursor so a resumed run continues the same data order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable

from asyncrl.types import Prompt


class PromptSource:
    """Hands out prompts from any iterable or async iterable, one at a time, to any number of producers.

    ``cursor`` counts prompts handed out; ``PromptSource(items, start=cursor)`` skips that many, so a run
    restored from a checkpoint sees the same order from where it stopped.
    """

    def __init__(self, items: Iterable[Prompt] | AsyncIterable[Prompt], start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"PromptSource start must be >= 0, got {start}")
        self._iter = _aiter(items)
        self._lock = asyncio.Lock()
        self._skip = start
        self.cursor = start  # prompts handed out so far (including skipped ones on resume)
        self.exhausted = False

    async def next(self) -> tuple[int, Prompt] | None:
        """The next prompt and its index in the stream, or None when the source is exhausted."""
        async with self._lock:
            while self._skip:
                self._skip -= 1
                if await self._pull() is None:
                    return None
            prompt = await self._pull()
            if prompt is None:
                return None
            index = self.cursor
            self.cursor += 1
            return index, prompt

    async def _pull(self) -> Prompt | None:
        try:
            return await anext(self._iter)
        except StopAsyncIteration:
            self.exhausted = True
            return None


async def _from_sync(items: Iterable[Prompt]) -> AsyncIterator[Prompt]:
    for item in items:
        yield item


def _aiter(items: Iterable[Prompt] | AsyncIterable[Prompt]) -> AsyncIterator[Prompt]:
    if isinstance(items, AsyncIterable):
        return aiter(items)
    return _from_sync(items)
