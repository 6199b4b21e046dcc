"""The record of an engine's shared-memory segments (``engines/shm_segments.py``), with real segments: those its
processes map are recorded by inode; one still mapped by a live process is never unlinked (its directory stays for
a later collection); once nobody maps it, releasing the record unlinks it, and a name reused by another file is
left alone."""

from __future__ import annotations

import os
from multiprocessing import shared_memory
from pathlib import Path

from asyncrl.engines.shm_segments import SHM, record_segments, release_segments


def test_a_recorded_segment_goes_only_once_nobody_maps_it(tmp_path: Path) -> None:
    segment = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this process, as vLLM's are
    name = segment.name.lstrip("/")
    try:
        assert name in record_segments(tmp_path, [os.getpid()])
        assert not release_segments(tmp_path), "a segment a live process maps is not ours to unlink"
        assert (SHM / name).exists()
    finally:
        segment.close()  # unmapped: now only the record knows it
    assert release_segments(tmp_path)
    assert not (SHM / name).exists()
    shared_memory.resource_tracker.unregister(segment._name, "shared_memory")  # unlinked by us, not leaked


def test_a_name_reused_by_another_file_is_left_alone(tmp_path: Path) -> None:
    segment = shared_memory.SharedMemory(create=True, size=4096)
    name = segment.name.lstrip("/")
    try:
        record_segments(tmp_path, [os.getpid()])
    finally:
        segment.close()
        segment.unlink()
    other = SHM / name  # a new file under the same name: another inode
    other.write_bytes(b"x")
    try:
        assert release_segments(tmp_path)
        assert other.exists()
    finally:
        other.unlink()
