"""Running a main coroutine under uvloop (falls back to the default loop where uvloop is missing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True, debug: bool = False) -> T:
    """``asyncio.run`` with uvloop's event loop. Ctrl-C cancels ``main``, which then shuts down cleanly."""
    loop_factory = None
    if use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            log.warning("uvloop is not installed; using the default asyncio event loop")
    with asyncio.Runner(loop_factory=loop_factory, debug=debug) as runner:
        return runner.run(main)
