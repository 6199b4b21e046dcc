"""A real engine and a real server start under a long TMPDIR (80 bytes: vLLM's socket paths under it would
pass the 107 a UNIX socket path holds): their socket directories fall back to /tmp, and go at shutdown."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.engines.rpc_dir import ENV, PREFIX
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server
from tests.support import SERVER_TEST_ARGS, engine_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LENGTH = 80
SHORT_BASE = "/tmp"  # where socket directories go when the temp dir is too long


@pytest.fixture
def long_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    long = tmp_path / ("t" * (LENGTH - len(str(tmp_path)) - 1))
    long.mkdir()
    assert len(str(long)) == LENGTH
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(long))  # the processes vLLM spawns
    monkeypatch.setattr(tempfile, "tempdir", str(long))  # this one (gettempdir caches)
    before = _ours()  # the session's shared engine, started earlier by this process, has one of its own
    yield long
    assert not _ours() - before, "a socket directory outlived its engine"


def _ours() -> set[Path]:
    return set(Path(SHORT_BASE).glob(f"{PREFIX}{os.getpid()}-*"))


def _has_sockets(path: Path) -> bool:
    return any(p.is_socket() for p in path.iterdir())


async def test_an_engine_starts_under_a_long_tmpdir(tiny_model_dir: Path, long_tmpdir: Path) -> None:
    before = _ours()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16), name="long-tmpdir")
    try:
        [rpc] = _ours() - before
        assert _has_sockets(rpc)
    finally:
        await engine.close()


async def test_a_server_starts_under_a_long_tmpdir(tiny_model_dir: Path, long_tmpdir: Path) -> None:
    async with start_vllm_server(tiny_model_dir, free_port(), extra_args=SERVER_TEST_ARGS) as server:
        assert server.rpc_dir is not None and server.rpc_dir.parent == Path(SHORT_BASE)
        assert _has_sockets(server.rpc_dir)
        assert server.log_path.parent == long_tmpdir  # only the sockets needed a short path
    assert not server.rpc_dir.exists()
