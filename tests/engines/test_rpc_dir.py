"""Where vLLM's socket directories go (no engine is started here): named by the process that owns them, so a
killed process's directory is collected by the next one made under the same base; and short enough for a
UNIX socket path whatever the temp dir is, or refused with an error that names the base and its length."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.engines import rpc_dir
from asyncrl.engines.rpc_dir import ENV, PREFIX, make_rpc_dir, remove_rpc_dir

SOCKET_PATH_MAX = 107  # ZMQ's limit for an ipc:// path
UUID4 = "/0f8fad5b-d9cb-469f-a165-70867728950e"  # what vLLM adds: ipc://{base}/{uuid4}


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rpc-"))  # short, unlike tmp_path
    monkeypatch.setenv(ENV, str(path))
    yield path
    remove_rpc_dir(path)


def test_a_killed_owners_socket_directory_is_collected_by_the_next_one(base: Path) -> None:
    make = "from asyncrl.engines.rpc_dir import make_rpc_dir; import sys, time; print(make_rpc_dir(), flush=True);" \
           " time.sleep(600)"
    owner = subprocess.Popen([sys.executable, "-c", make], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    left = Path(owner.stdout.readline().strip())
    assert left.parent == base and left.name.startswith(f"{PREFIX}{owner.pid}-")
    (left / "a-socket-vllm-never-removed").touch()
    mine = make_rpc_dir()  # the owner is alive: its directory stays
    assert left.is_dir() and mine.name.startswith(f"{PREFIX}{os.getpid()}-")
    owner.kill()  # kill -9: nothing of it gets to clean up
    owner.wait()
    other = make_rpc_dir()
    assert not left.exists(), "a dead process's socket directory outlived it"
    assert mine.is_dir() and other.is_dir(), "the live owner's directories are kept"


def test_socket_paths_stay_short_under_a_long_temp_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    long = tmp_path / ("t" * max(1, 80 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(long))  # what TMPDIR=long gives
    made = make_rpc_dir()
    try:
        assert len(os.fsencode(str(made) + UUID4)) <= SOCKET_PATH_MAX, made
        assert made.parent == Path("/tmp")
    finally:
        remove_rpc_dir(made)


def test_a_chosen_base_too_long_for_socket_paths_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    long = tmp_path / ("b" * max(1, 80 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setenv(ENV, str(long))
    with pytest.raises(ValueError, match=rf"{ENV} .* is {len(str(long))} bytes long"):
        make_rpc_dir()
    assert not list(long.iterdir())
    # The longest base allowed still gives paths that fit.
    short = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    try:
        fits = short / ("c" * (rpc_dir.room_for_base() - len(str(short)) - 1))
        fits.mkdir()
        made = make_rpc_dir(str(fits))
        assert len(os.fsencode(str(made) + UUID4)) <= SOCKET_PATH_MAX, (len(str(made) + UUID4), made)
    finally:
        remove_rpc_dir(short)
