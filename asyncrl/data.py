"""Prompt sources shared by producers, with a cursor so a resumed run continues the same data order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from asyncrl.types import Prompt

_END: Prompt = object()  # type: ignore[assignment]  # what ``next`` returns once a plain iterator is done


class PromptSource:
    """Hands out prompts from any iterable or async iterable, one at a time, to any number of producers.

    ``cursor`` counts prompts handed out; ``PromptSource(items, start=cursor)`` skips that many, so a run
    restored from a checkpoint sees the same order from where it stopped.
    """

    def __init__(self, items: Iterable[Prompt] | AsyncIterable[Prompt], start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"PromptSource start must be >= 0, got {start}")
        # A plain iterable is read directly: wrapping it in an async generator costs more per prompt than
        # the rest of ``next``, and pulling from it never suspends, so it needs no lock either.
        is_async = isinstance(items, AsyncIterable)
        self._sync: Iterator[Prompt] | None = None if is_async else iter(items)
        self._iter: AsyncIterator[Prompt] | None = aiter(items) if is_async else None
        self._lock = asyncio.Lock()  # an async pull can suspend: one caller at a time
        self._skip = start
        self.cursor = start  # prompts handed out so far (including skipped ones on resume)
        self.exhausted = False

    async def next(self) -> tuple[int, Prompt] | None:
        """The next prompt and its index in the stream, or None when the source is exhausted."""
        if self._sync is not None:
            return self._next_sync(self._sync)
        async with self._lock:
            while self._skip:
                self._skip -= 1
                if await self._pull() is None:
                    return None
            return self._hand_out(await self._pull())

    def _next_sync(self, items: Iterator[Prompt]) -> tuple[int, Prompt] | None:
        while self._skip:
            self._skip -= 1
            if next(items, _END) is _END:
                self.exhausted = True
                return None
        prompt = next(items, _END)
        if prompt is _END:
            self.exhausted = True
            return None
        return self._hand_out(prompt)

    def _hand_out(self, prompt: Prompt | None) -> tuple[int, Prompt] | None:
        if prompt is None:
            return None
        index = self.cursor
        self.cursor += 1
        return index, prompt

    async def _pull(self) -> Prompt | None:
        try:
            return await anext(self._iter)  # type: ignore[arg-type]
        except StopAsyncIteration:
            self.exhausted = True
            return None
