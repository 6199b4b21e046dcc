"""Durable file writes for checkpoints: fsync, checksums and an atomic move into place."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"


def write_file(path: Path, write: Callable[[Path], object]) -> str:
    """Write one file with ``write(path)``, fsync it, and return its sha256."""
    write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sha256(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (a re-run of that step) is replaced."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
