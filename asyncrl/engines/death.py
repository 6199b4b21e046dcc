"""One engine's death as an event: declared once by whatever observes it, awaited by everyone who cares.

The observer is the engine's own: vLLM's engine-core processes exiting (``VLLMEngine``), a failed health probe
(``RemoteVLLMEngine``, where HTTP is the only signal), a member's death (``EnginePool``), a test's switch
(``FakeEngine``). Callers never poll: the pipeline awaits ``Lifecycle.wait_dead`` and control calls are raced
against the event (``Death.race``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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


def watch_sentinels(sentinels: list[Any], name: str, died: Callable[[], object]) -> Any:
    """Call ``died`` in the running event loop once any of the process ``sentinels`` becomes ready (its process
    exited). A thread waits on them beside a pipe; closing the returned end (None when there is nothing to
    watch) ends the thread without calling ``died``: the processes exit because we asked them to."""
    if not sentinels:
        return None
    loop = asyncio.get_running_loop()
    stop_r, stop_w = multiprocessing.Pipe(duplex=False)

    def watch() -> None:
        with stop_r:
            if stop_r in multiprocessing.connection.wait([*sentinels, stop_r]):
                return
        try:
            loop.call_soon_threadsafe(died)
        except RuntimeError:  # the event loop is gone: nobody is left to tell
            pass

    threading.Thread(target=watch, name=name, daemon=True).start()
    return stop_w
