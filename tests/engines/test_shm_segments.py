"""The record of an engine's shared-memory segments (``engines/shm_segments.py``), with real segments made by a
real child process, as vLLM's engine core makes them: those its processes map are recorded by inode; one still
mapped by a live process is never unlinked (its directory stays for a later collection); once nobody maps it,
releasing the record unlinks it, and a name reused by another file is left alone.

The segments are made in a child, never in the test process: under the full suite this process owns a running
vLLM engine, whose own segments would join the record."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.engines.shm_segments import SHM, record_segments, release_segments

# Makes a segment, leaves it out of the resource tracker (so only our record knows it, as after a kill -9), prints
# its name, keeps it mapped until stdin closes, then unmaps it and exits without unlinking.
MAKER = """
import sys
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(segment._name, "shared_memory")
print(segment.name.lstrip("/"), flush=True)
sys.stdin.read()
segment.close()
"""


@pytest.fixture
def maker() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name, "the child made no segment"
    try:
        yield proc, name
    finally:
        proc.kill()
        proc.wait(timeout=30)
        (SHM / name).unlink(missing_ok=True)


def _unmap(proc: subprocess.Popen[str]) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_a_recorded_segment_goes_only_once_nobody_maps_it(tmp_path: Path, maker) -> None:
    proc, name = maker
    assert record_segments(tmp_path, [proc.pid]) == [name]
    assert not release_segments(tmp_path), "a segment a live process maps is not ours to unlink"
    assert (SHM / name).exists()
    _unmap(proc)  # now only the record knows it
    assert (SHM / name).exists()
    assert release_segments(tmp_path)
    assert not (SHM / name).exists()


def test_a_name_reused_by_another_file_is_left_alone(tmp_path: Path, maker) -> None:
    proc, name = maker
    assert record_segments(tmp_path, [proc.pid]) == [name]
    _unmap(proc)
    (SHM / name).unlink()
    other = SHM / name  # a new file under the same name: another inode
    other.write_bytes(b"x")
    assert release_segments(tmp_path)
    assert other.exists()
