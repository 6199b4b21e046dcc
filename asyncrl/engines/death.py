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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from asyncrl.aio import TaskOwner
from asyncrl.errors import EngineError

T = TypeVar("T")
# A call cut short by a death is cancelled and awaited this long at most: a dead engine never answers it, and a
# call that holds on to its cancellation must not hold the caller with it.
RACE_CLOSE_TIMEOUT_S = 5.0


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

    async def race(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` unless the engine dies first: then it is cancelled and the death raised (a dead
        engine never answers the call). Cancelling the caller cancels it. Both it and the wait for the death
        are tasks of a ``TaskOwner`` scoped to this call: neither outlives it."""
        if self.error is not None:
            coro.close()  # never started: nothing reaches the dead engine
            raise self.error
        async with TaskOwner("death-race", timeout_s=RACE_CLOSE_TIMEOUT_S) as owner:
            task = owner.start(coro)
            dead = owner.start(self._event.wait())
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            assert self.error is not None
            raise self.error


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
