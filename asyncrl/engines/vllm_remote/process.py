"""Launch a vLLM OpenAI server as a child process group, and make sure none of it outlives us.

A guardian process (``guardian.py``) leads a new process group and starts the server in it; the server (API
process) spawns an EngineCore and a worker. All four share the group, so one ``killpg`` reaches them all, even
after the API process itself is gone. The guardian exits when the server does, the way it did; and if this
process dies, SIGKILL included, the guardian takes the whole group down and removes the server's socket
directory and temporary log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from asyncrl.aio import TaskOwner
from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.engines.rpc_dir import ENV as RPC_ENV
from asyncrl.engines.rpc_dir import make_rpc_dir, remove_rpc_dir
from asyncrl.engines.vllm_local.config import WORKER_EXTENSION
from asyncrl.engines.vllm_remote import guardian
from asyncrl.engines.vllm_remote.guardian import group_members

__all__ = ["DEFAULT_ENV", "ServerProcess", "free_port", "group_members", "server_args", "server_env",
           "server_precision_args", "start_vllm_server"]

log = logging.getLogger(__name__)

# What every server we start gets unless the caller's ``env`` says otherwise.
DEFAULT_ENV: Mapping[str, str] = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, weight-transfer endpoints
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; without it vLLM CPU takes most of the RAM
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # its INFO lines (a hundred per start) are noise in the server's log
}
USER_WINS = ("VLLM_LOGGING_LEVEL",)  # defaults this process's environment overrides

# What torchrun (and torch elastic) tell their workers. A server started from a learner rank must not see
# them: with TORCHELASTIC_USE_AGENT_STORE set, torch's tcp:// rendezvous connects to the given port as a client
# instead of hosting the store, so a vLLM that sets up its own world that way waits for a store nobody hosts.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_ENV_PREFIX = "TORCHELASTIC_"


def server_env(env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default ``os.environ``) without the launcher's variables, then
    ``DEFAULT_ENV``, then ``env``. The worker imports asyncrl's extension by name, so the server must find
    asyncrl the way this process did: installed in the same interpreter, or through the PYTHONPATH it
    inherits (a source checkout)."""
    inherited = {k: v for k, v in (os.environ if base is None else base).items()
                 if k not in LAUNCHER_ENV and not k.startswith(LAUNCHER_ENV_PREFIX)}
    # A log level the user set wins, as for the in-process engine (``VLLMEngineConfig.log_level``).
    defaults = {k: v for k, v in DEFAULT_ENV.items() if k not in USER_WINS or k not in inherited}
    return {**inherited, **defaults, **(env or {})}


def server_args(model_dir: str | Path, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The server command line. ``extra_args`` come last, so a repeated flag overrides the default."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        # Behaviour log-probs must be those of the distribution actually sampled (after temperature).
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION,  # weight reload that keeps tied weights (the LM head) tied
        *_platform_args(),
        *extra_args,
    ]


def server_precision_args(precision: BehaviourPrecision) -> list[str]:
    """The server flags that make it sample in ``precision``: pass them in ``start_vllm_server(extra_args=...)``
    and the same ``precision`` as ``RemoteEngineConfig.precision``, so what the server does and what the engine
    declares cannot drift apart."""
    args = ["--dtype", precision.dtype]
    if precision.quantization is not None:
        args += ["--quantization", precision.quantization]
    if precision.kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", precision.kv_cache_dtype]
    return args


def _platform_args() -> list[str]:
    from asyncrl.engines.vllm_local.config import whole_prompts_only

    return ["--no-enable-chunked-prefill"] if whole_prompts_only() else []


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (another process may take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """A running vLLM server started by ``start_vllm_server``."""

    process: asyncio.subprocess.Process  # the guardian: leads the group, exits when the server does, as it did
    port: int
    model_dir: Path
    log_path: Path  # the server's stdout and stderr
    rpc_dir: Path | None = None  # vLLM's IPC sockets (VLLM_RPC_BASE_PATH), removed once the server is gone

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """The name the server serves the model under (its ``--model`` path, unless overridden)."""
        return str(self.model_dir)

    @property
    def pgid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the whole process group at once (what a crash looks like). Does not wait."""
        _signal_group(self.pgid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout_s``. Idempotent."""
        _signal_group(self.pgid, signal.SIGTERM)
        try:
            await _wait_group_gone(self.process, self.pgid, timeout_s)
        except TimeoutError:
            log.warning("vLLM server on port %d ignored SIGTERM for %.0fs; killing its process group",
                        self.port, timeout_s)
            _signal_group(self.pgid, signal.SIGKILL)
            await _wait_group_gone(self.process, self.pgid, 10.0)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # already gone


async def _wait_group_gone(process: asyncio.subprocess.Process, pgid: int, timeout_s: float) -> None:
    """Wait for the API process (an exit event) and then for its descendants, which are not our children:
    there is no event for their exit, so their group is re-checked every 50 ms until the deadline."""
    async with asyncio.timeout(timeout_s):
        await process.wait()
        while group_members(pgid):
            await asyncio.sleep(0.05)


async def _wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    """Poll GET /health until it answers 200, the process exits, or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    async with (TaskOwner("server-exit") as owner,  # the wait for the exit ends with this call
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session):
        exited = owner.start(server.process.wait())
        while True:
            if await _health_ok(session, server.base_url):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"vLLM server on port {server.port} not healthy after {timeout_s:.0f}s;"
                                   f" log tail:\n{server.log_tail()}")
            done, _ = await asyncio.wait({exited}, timeout=min(0.5, left))
            if done:
                raise RuntimeError(f"vLLM server on port {server.port} exited with code "
                                   f"{server.process.returncode} during start-up; log tail:\n"
                                   f"{server.log_tail()}")


async def _health_ok(session: aiohttp.ClientSession, base_url: str) -> bool:
    try:
        async with session.get(f"{base_url}/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


@asynccontextmanager
async def start_vllm_server(model_dir: str | Path, port: int, *, extra_args: Sequence[str] = (),
                            env: Mapping[str, str] | None = None, startup_timeout_s: float = 240.0,
                            log_path: str | Path | None = None) -> AsyncIterator[ServerProcess]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` in its own process group and wait until
    /health answers. On exit (normal, error or cancellation) the whole group is terminated.

    ``env`` is added on top of ``DEFAULT_ENV`` and this process's environment, less a launcher's variables
    (``server_env``), so a learner rank under torchrun can start one. The log goes to ``log_path``, else to a
    new file under the temp dir that is removed after a clean exit or a cancellation and kept, for the
    post-mortem, when the server failed to start or the block raised. vLLM's IPC sockets go to a private
    directory under ``VLLM_RPC_BASE_PATH`` (``env``'s, else this process's, else the temp dir: ``rpc_dir``),
    removed on exit. If this process dies without exiting the block (SIGKILL), the server's guardian stops the
    server and removes that directory and the temporary log.
    """
    rpc_dir = make_rpc_dir((env or {}).get(RPC_ENV))
    temp_log = None if log_path is not None else _temp_log(port)
    failed = True
    try:
        server = await _spawn(model_dir, port, extra_args, {**(env or {}), RPC_ENV: str(rpc_dir)},
                              log_path or temp_log, rpc_dir, temp_log)
        try:
            t0 = time.monotonic()
            await _wait_healthy(server, startup_timeout_s)
            log.info("vLLM server on port %d healthy after %.1fs", port, time.monotonic() - t0)
            yield server
            failed = False
        finally:
            try:
                await server.stop()
            except BaseException:
                server.kill()  # cancelled or timed out while stopping: leave no orphan behind
                raise
    except asyncio.CancelledError:
        failed = False  # stopped on purpose: nothing to look into
        raise
    finally:
        remove_rpc_dir(rpc_dir)  # every process of the group is gone (or SIGKILLed): nothing binds there now
        if temp_log is not None:
            if failed:
                log.warning("vLLM server log kept for the post-mortem: %s", temp_log)
            else:
                temp_log.unlink(missing_ok=True)


def _temp_log(port: int) -> Path:
    fd, name = tempfile.mkstemp(prefix=f"vllm-server-{port}-", suffix=".log")
    os.close(fd)
    return Path(name)


async def _spawn(model_dir: str | Path, port: int, extra_args: Sequence[str], env: Mapping[str, str],
                 log_path: str | Path, rpc_dir: Path, temp_log: Path | None) -> ServerProcess:
    log_path = Path(log_path)
    removed = [str(p) for p in (rpc_dir, temp_log) if p is not None]  # by the guardian if we die
    command = [sys.executable, "-I", guardian.__file__, "--starter", str(os.getpid()),
               *(arg for path in removed for arg in ("--remove", path)), "--",
               *server_args(model_dir, port, extra_args)]
    with log_path.open("ab") as log_file:
        # A file, not a pipe: nobody would drain a pipe, and a full pipe blocks the server.
        process = await asyncio.create_subprocess_exec(
            *command, env=server_env(env), stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
    log.info("started vLLM server pid %d on port %d (log %s)", process.pid, port, log_path)
    return ServerProcess(process=process, port=port, model_dir=Path(model_dir), log_path=log_path, rpc_dir=rpc_dir)
