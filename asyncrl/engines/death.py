"""One engine's death as an event: declared once by whatever observes it, awaited by everyone who cares.

The observer is the engine's own: vLLM's engine-core processes exiting (``VLLMEngine``), a failed health probe
(``RemoteVLLMEngine``, where HTTP is the only signal), a member's death (``EnginePool``), a test's switch
(``FakeEngine``). Callers never poll: the pipeline awaits ``Lifecycle.wait_dead`` and control calls are raced
against the event (``Death.race``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from asyncrl.errors import EngineError

T = TypeVar("T")


class Death:
    """The death of one engine (or its closing: either way nothing it was asked will be answered)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.error: EngineError | None = None  # why, once declared

    @property
    def declared(self) -> bool:
        return self.error is not None

    def declare(self, error: EngineError) -> None:
        """The engine is gone, for ``error``'s reason. The first declaration wins; the rest are ignored."""
        if self.error is None:
            self.error = error
            self._event.set()

    async def wait(self) -> EngineError:
        """Return (not raise) the error once the death is declared."""
        await self._event.wait()
        assert self.error is not None
        return self.error

    async def race(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the engine dies first: then ``aw`` is cancelled and the death raised (a dead
        engine never answers the call). Cancelling the caller cancels ``aw``."""
        task = asyncio.ensure_future(aw)
        if self.error is not None:
            task.cancel()  # never started: nothing reaches the dead engine
            raise self.error
        dead = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            assert self.error is not None
            raise self.error
        finally:
            task.cancel()
            dead.cancel()

