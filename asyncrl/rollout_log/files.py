"""The rollout log's files, written in one thread: a stream file per run segment and ``steps_per_file`` steps,
one record batch per step written straight to the file descriptor, and the oldest files deleted to stay within
``max_bytes``.

Files are named ``seg-SSSSSS-step-NNNNNNNNN.arrows``: the segment (one per opened log, numbered on from the
directory's newest) and the first step they hold. A segment that starts at step ``s`` supersedes every step
``>= s`` of earlier segments (a run resumed from a checkpoint logs those steps again, as it trains them again).

Kill -9 safety: each step is one IPC message written with plain ``write`` calls (no user-space buffer), so a
killed writer leaves whole steps followed by at most one torn message, which ``reader`` discards. Files are
fsynced when closed (a power loss may lose the steps of the file being written).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from asyncrl.config import RolloutLogConfig
from asyncrl.rollout_log.schema import StepRecord, schema_with, to_batch

log = logging.getLogger(__name__)

SUFFIX = ".arrows"
_NAME = re.compile(r"^seg-(\d{6})-step-(\d{9})\.arrows$")


class RolloutLogError(RuntimeError):
    """The rollout log cannot be written (a step over its size bound, a full disk...)."""


@dataclass(frozen=True, slots=True, order=True)
class LogFile:
    """One file of a log, ordered as written."""

    segment: int
    first_step: int
    path: Path


def log_files(directory: str | Path) -> list[LogFile]:
    """The log's files in the order they were written (other names in the directory are ignored)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(LogFile(int(m.group(1)), int(m.group(2)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))


class LogFiles:
    """Writes steps into a log directory. Not thread-safe: one thread calls it (``RolloutLog``'s writer)."""

    def __init__(self, config: RolloutLogConfig, header: dict[str, Any]) -> None:
        self.config = config
        self.dir = Path(config.dir)
        self.schema = schema_with(header)
        self.file_limit = config.max_bytes // 4
        self.segment: int | None = None  # chosen at the first write
        self._sink: Any = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._path: Path | None = None
        self._steps_in_file = 0
        self.bytes = 0  # the log's size on disk, as of the last write

    def write(self, record: StepRecord) -> int:
        """Append one step (rotating and pruning first); returns the log's size in bytes."""
        batch, meta = to_batch(record)
        size = pa.ipc.get_record_batch_size(batch) + len(meta) + 512  # + the message's own framing
        if size > self.file_limit:
            raise RolloutLogError(f"step {record.step} takes {size} bytes in the rollout log, over max_bytes / 4 = "
                                  f"{self.file_limit} (RolloutLogConfig.max_bytes)")
        if self._writer is not None and (self._steps_in_file >= self.config.steps_per_file
                                         or self._sink.tell() + size > self.file_limit):
            self.close()
        if self._writer is None:
            self._open(record.step)
        self._prune(size)
        assert self._writer is not None
        self._writer.write_batch(batch, custom_metadata={b"asyncrl.step": meta})
        self._steps_in_file += 1
        self.bytes = sum(_size(f.path) for f in log_files(self.dir))
        return self.bytes

    def close(self) -> None:
        """End the current file (the stream's end marker, fsync); the next write starts a new one."""
        writer, sink, self._writer, self._sink = self._writer, self._sink, None, None
        if writer is None:
            return
        try:
            writer.close()
            os.fsync(sink.fileno())
        finally:
            sink.close()

    def open_sink(self, path: Path) -> Any:
        """The file a stream is written to: an unbuffered ``pyarrow.OSFile``."""
        return pa.OSFile(str(path), "wb")

    def _open(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.segment is None:
            self.segment = max((f.segment for f in log_files(self.dir)), default=0) + 1
        self._path = self.dir / f"seg-{self.segment:06d}-step-{step:09d}{SUFFIX}"
        self._sink = self.open_sink(self._path)
        try:
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
        except BaseException:
            self._sink.close()
            self._sink = None
            raise
        self._steps_in_file = 0

    def _prune(self, incoming: int) -> None:
        """Delete the oldest files until the log plus ``incoming`` bytes fits ``max_bytes``."""
        older = [f for f in log_files(self.dir) if f.path != self._path]
        total = sum(_size(f.path) for f in older) + _size(self._path)
        while older and total + incoming > self.config.max_bytes:
            oldest = older.pop(0)
            total -= _size(oldest.path)
            oldest.path.unlink(missing_ok=True)
            log.info("rollout log: deleted %s to stay within max_bytes=%d", oldest.path.name, self.config.max_bytes)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except FileNotFoundError:
        return 0
