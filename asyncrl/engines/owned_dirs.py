"""Directories named by the process that owns them, so that what a killed process leaves is collected.

A directory is ``{prefix}{pid}-{random}`` under its root. Whoever makes a new one under the same root with the
same prefix first removes those whose owner is no longer running: a process that dies without cleaning up
(``kill -9``) leaves nothing for good. Staged weights (``weights.py``) and vLLM's socket directories
(``rpc_dir.py``) both work this way; a socket directory also records vLLM's shared-memory segments, which a
``release`` hook unlinks before the directory goes (``shm_segments.py``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RANDOM_CHARS = 8  # what tempfile.mkdtemp adds after the prefix


def owned_name_length(prefix: str, pid: int | None = None) -> int:
    """The length of the name ``make_owned_dir`` gives a directory of ``pid`` (default: this process)."""
    return len(prefix) + len(str(os.getpid() if pid is None else pid)) + 1 + RANDOM_CHARS


Release = Callable[[Path], bool]  # frees what a directory records before it goes; False: keep it for now


def make_owned_dir(root: Path, prefix: str, release: Release | None = None) -> Path:
    """Collect the dead owners' directories under ``root`` (``release`` first, if given), then make one for this
    process."""
    collect_dead_owners(root, prefix, release)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))


def collect_dead_owners(root: Path, prefix: str, release: Release | None = None) -> list[Path]:
    """Remove the ``prefix`` directories under ``root`` whose owner is gone, each after ``release(dir)`` (if
    given) has freed what it records; one whose ``release`` returns False stays. Returns what was removed."""
    named = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = named.match(entry.name)
        if match and not pid_alive(int(match.group(1))) and entry.is_dir():
            if release is not None and not release(entry):
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed %d %s* directories left by dead processes under %s", len(removed), prefix, root)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
