"""Running a main coroutine under uvloop (falls back to the default loop where uvloop is missing), with SIGTERM
handled as Ctrl-C is.

SIGTERM is what ``timeout``, ``docker stop``, systemd, Kubernetes, Slurm and torchrun send to stop a job. Left to
its default it kills the process at once, and the engine's processes, staged weights and sockets outlive it. So
``run`` turns it into a cancellation of the main coroutine: ``CancelledError`` unwinds everything, the engine
shuts down, and ``run`` then raises ``Terminated`` (exit status 143, no traceback).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class Terminated(SystemExit):
    """``run``'s main coroutine was cancelled by SIGTERM and has shut down. A ``SystemExit`` with status 143
    (128 + SIGTERM, what a shell reports for a process SIGTERM ended): uncaught, it ends the program quietly."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True, debug: bool = False) -> T:
    """``asyncio.run`` with uvloop's event loop. Ctrl-C cancels ``main`` and then raises ``KeyboardInterrupt``;
    SIGTERM cancels it and then raises ``Terminated``: either way ``main`` has shut down cleanly first. A SIGTERM
    handler the program set itself (``signal.signal``) is left alone."""
    loop_factory = None
    if use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            log.warning("uvloop is not installed; using the default asyncio event loop")
    sigterm = _SigtermCancels()
    with asyncio.Runner(loop_factory=loop_factory, debug=debug) as runner:
        try:
            return runner.run(sigterm.guard(main))
        except asyncio.CancelledError:
            if sigterm.received:
                raise Terminated() from None
            raise


class _SigtermCancels:
    """Cancels the task running ``guard`` on the first SIGTERM; later ones are ignored, so that they cannot cut
    the shutdown short (a supervisor follows up with SIGKILL if it will not wait)."""

    def __init__(self) -> None:
        self.received = False
        self._task: asyncio.Task[Any] | None = None

    async def guard(self, main: Coroutine[Any, Any, T]) -> T:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        installed = self._install(loop)
        try:
            return await main
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGTERM)

    def _install(self, loop: asyncio.AbstractEventLoop) -> bool:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False  # the program's own handler
        try:
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            log.debug("SIGTERM is not handled here (not the main thread)")
            return False
        return True

    def _on_sigterm(self) -> None:
        if self.received:
            log.warning("SIGTERM again: already shutting down")
            return
        self.received = True
        log.warning("SIGTERM: cancelling the run")
        assert self._task is not None
        self._task.cancel()
