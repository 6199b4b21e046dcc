"""Starting an ``AsyncLLM`` off the event loop, and shutting down a start that was cancelled.

vLLM's start-up blocks for tens of seconds, so it runs in a thread; the sockets it binds go to the engine's
private directory (``rpc_dir``) and the environment the configuration decides holds for the start-up only. A
thread cannot be stopped: a cancelled start is let finish, then whatever it started is shut down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncrl.engines.env import scoped_env
from asyncrl.engines.rpc_dir import remove_rpc_dir, rpc_dir_in_env


def start_llm(args: Any, env: dict[str, str], rpc_dir: Path) -> Any:
    """``AsyncLLM.from_engine_args(args)`` (blocking: call it in a thread)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with rpc_dir_in_env(rpc_dir), scoped_env(env):
        return AsyncLLM.from_engine_args(args)


async def close_when_started(starting: asyncio.Future[Any], rpc_dir: Path,
                             close: Callable[[Any], Awaitable[None]]) -> None:
    """Wait for a cancelled start to end, then ``close(llm)`` what it started (nothing if it failed)."""
    try:
        llm = await starting
    except Exception:
        remove_rpc_dir(rpc_dir)
        return  # it failed to start: vLLM has shut down what it had started
    await close(llm)
