"""Shutdown leaves no socket file (nor vLLM's rendezvous file): vLLM binds its IPC endpoints as UNIX sockets
named by UUIDs under VLLM_RPC_BASE_PATH (the temp dir by default) and never removes them; each engine and server
we start puts them in a private directory that goes at shutdown, cancelled or killed ones included. An in-process
engine also removes the ``file://`` rendezvous file vLLM leaves in the temp dir.

The base is a directory of the test's own (set through VLLM_RPC_BASE_PATH, which the private directories go
under), so that nothing else running on the machine puts files where the test looks.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncrl.engines.rpc_dir import ENV, PREFIX
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server
from tests.support import SERVER_TEST_ARGS, engine_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """VLLM_RPC_BASE_PATH for the test: a new directory under the temp dir (short: a socket path must fit in
    107 bytes), which must be empty again at the end."""
    path = Path(tempfile.mkdtemp(prefix="rpc-base-"))
    monkeypatch.setenv(ENV, str(path))
    yield path
    left = sorted(str(p.relative_to(path)) for p in path.rglob("*"))
    shutil.rmtree(path)
    assert not left, f"left in {path}: {left}"


def _bound_sockets(base: Path) -> Callable[[], bool]:
    """True once a private directory holds a socket vLLM bound; none may land in the base itself."""
    def cond() -> bool:
        entries = list(base.iterdir())
        assert all(p.name.startswith(PREFIX) and p.is_dir() for p in entries), f"outside a private dir: {entries}"
        return any(p.is_socket() for p in base.glob(f"{PREFIX}*/*"))
    return cond


async def _until(cond: Callable[[], bool], timeout_s: float = 120.0) -> None:
    # vLLM's start-up gives no event for "bound its sockets": check the directory every 50 ms up to a deadline.
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "vLLM bound no socket in time"
        await asyncio.sleep(0.05)


async def test_an_engine_closed_or_cancelled_while_starting_leaves_no_socket_file(
        tiny_model_dir: Path, base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16), name="sockets")
    rendezvous = list(engine._store_files)  # vLLM's file:// rendezvous, which it never removes either
    try:
        assert _bound_sockets(base)(), "the running engine's sockets are in its own directory"
        assert rendezvous and all(f.is_file() for f in rendezvous)
    finally:
        await engine.close()
    assert not list(base.iterdir())
    assert not any(f.exists() for f in rendezvous), "the rendezvous file goes with the engine"

    closed: list[Path] = []
    close = VLLMEngine.close

    async def recording_close(self: VLLMEngine) -> None:
        closed.extend(self._store_files)
        await close(self)

    monkeypatch.setattr(VLLMEngine, "close", recording_close)
    start = asyncio.create_task(VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16)))
    await _until(_bound_sockets(base))
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert not list(base.iterdir())
    assert closed and not any(f.exists() for f in closed), "nor does a cancelled start's rendezvous file"


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The temp dir where servers put their default logs, for this test alone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _server_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("vllm-server-*.log"))


async def test_a_server_killed_or_cancelled_while_starting_leaves_no_socket_file(tiny_model_dir: Path,
                                                                                 base: Path, logs: Path) -> None:
    async with start_vllm_server(tiny_model_dir, free_port(), extra_args=SERVER_TEST_ARGS) as server:
        assert server.rpc_dir is not None and server.rpc_dir.parent == base
        assert _bound_sockets(base)()
        server.kill()  # a crash: nothing in the group gets to clean up
    assert not list(base.iterdir())

    async def serve() -> None:
        async with start_vllm_server(tiny_model_dir, free_port(), extra_args=SERVER_TEST_ARGS):
            pytest.fail("cancelled before it was healthy")

    task = asyncio.create_task(serve())
    await _until(lambda: task.done() or _bound_sockets(base)())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not list(base.iterdir())
    assert not _server_logs(logs), "default server logs are removed after a clean exit or a cancellation"


async def test_a_server_that_fails_to_start_keeps_its_log(tmp_path: Path, base: Path, logs: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with code") as err:
        async with start_vllm_server(tmp_path / "no-model-here", free_port(), extra_args=SERVER_TEST_ARGS):
            pytest.fail("a server without a model became healthy")
    [kept] = _server_logs(logs)  # the post-mortem evidence stays, and the error quotes its tail
    assert kept.stat().st_size > 0 and "no-model-here" in str(err.value) + kept.read_text()
    assert not list(base.iterdir())
