"""Prompt sources shared by producers, with a cursor so a resumed run continues the same data order."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence

from asyncrl.errors import ConfigError
from asyncrl.types import Prompt

_END: Prompt = object()  # type: ignore[assignment]  # what ``next`` returns once a plain iterator is done


class PromptSource:
    """Hands out prompts from any iterable or async iterable, one at a time, to any number of producers.

    ``cursor`` counts prompts handed out (across epochs); ``PromptSource(items, start=cursor)`` skips that many,
    so a run restored from a checkpoint sees the same order from where it stopped.

    A sequence (a list, a tuple) can be handed out ``epochs`` times (None: without end), each epoch in a seeded
    order when ``shuffle_seed`` is given: epoch ``e`` is a permutation drawn from ``(shuffle_seed, e)`` alone, so
    a resumed source jumps straight to ``cursor // len(items)`` and the order is the same as an unbroken run's.
    An iterator or async iterable is read once: it cannot be replayed, so it takes neither ``epochs`` other
    than 1 nor a shuffle. When the items run out the producers stop and ``Pipeline.run(steps=None)`` ends;
    ``run(steps=N)`` then fails with ``NoProgressError``.
    """

    def __init__(self, items: Iterable[Prompt] | AsyncIterable[Prompt], start: int = 0, epochs: int | None = 1,
                 shuffle_seed: int | None = None) -> None:
        if start < 0:
            raise ConfigError("PromptSource.start", f"must be >= 0, got {start}")
        if epochs is not None and epochs < 1:
            raise ConfigError("PromptSource.epochs", f"must be >= 1, or None to repeat without end; got {epochs}")
        self.epochs = epochs
        self.cursor = start  # prompts handed out so far (including skipped ones on resume)
        self.exhausted = False
        self._seq: Sequence[Prompt] | None = items if _is_sequence(items) else None
        if self._seq is None and (epochs != 1 or shuffle_seed is not None):
            what = "epochs=None" if epochs is None else f"epochs={epochs}" if epochs != 1 else "shuffle_seed"
            raise ConfigError("PromptSource.epochs" if epochs != 1 else "PromptSource.shuffle_seed",
                              f"{what} needs a sequence (a list or tuple) to replay or reorder, and "
                              f"{type(items).__name__} is read once; pass list(items)")
        self._seed = shuffle_seed
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) of the epoch being handed out
        # A plain iterable is read directly: wrapping it in an async generator costs more per prompt than
        # the rest of ``next``, and pulling from it never suspends, so it needs no lock either.
        is_async = isinstance(items, AsyncIterable)
        self._sync: Iterator[Prompt] | None = None if is_async or self._seq is not None else iter(items)
        self._iter: AsyncIterator[Prompt] | None = aiter(items) if is_async else None
        self._lock = asyncio.Lock()  # an async pull can suspend: one caller at a time
        self._skip = 0 if self._seq is not None else start

    def seek(self, cursor: int) -> None:
        """Position a source that has handed nothing out yet at ``cursor`` (a checkpoint's), as
        ``start=cursor`` would have: ``resume_pipeline`` does this for a source built with its epochs and seed."""
        if self.cursor != 0 or self._skip or self.exhausted:
            raise ConfigError("PromptSource.start", f"seek({cursor}) on a source already at {self.cursor}: "
                                                    "only a fresh source can be positioned")
        if cursor < 0:
            raise ConfigError("PromptSource.start", f"must be >= 0, got {cursor}")
        self.cursor = cursor
        self._skip = 0 if self._seq is not None else cursor

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0 for a stream read once)."""
        return self.cursor // len(self._seq) if self._seq else 0

    @property
    def total(self) -> int | None:
        """How many prompts this source hands out in all; None when that is unknown or without end."""
        if self._seq is None or self.epochs is None:
            return None
        return len(self._seq) * self.epochs

    async def next(self) -> tuple[int, Prompt] | None:
        """The next prompt and its index in the stream, or None when the source is exhausted."""
        if self._seq is not None:
            return self._next_indexed(self._seq)
        if self._sync is not None:
            return self._next_sync(self._sync)
        async with self._lock:
            while self._skip:
                self._skip -= 1
                if await self._pull() is None:
                    return None
            return self._hand_out(await self._pull())

    def _next_indexed(self, items: Sequence[Prompt]) -> tuple[int, Prompt] | None:
        # Where the cursor points is computed, not replayed: resuming far into a long run costs nothing.
        total = self.total
        if not items or (total is not None and self.cursor >= total):
            self.exhausted = True
            return None
        epoch, position = divmod(self.cursor, len(items))
        return self._hand_out(items[self._permutation(epoch, len(items))[position]])

    def _permutation(self, epoch: int, size: int) -> list[int]:
        if self._seed is None:
            return range(size)  # type: ignore[return-value]  # indexable like the list it stands for
        if self._order is None or self._order[0] != epoch:
            order = list(range(size))
            # A string seed is hashed the same way in every process (tuples and PYTHONHASHSEED are not).
            random.Random(f"asyncrl.PromptSource:{self._seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

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


def _is_sequence(items: object) -> bool:
    return isinstance(items, Sequence) and not isinstance(items, str | bytes)
