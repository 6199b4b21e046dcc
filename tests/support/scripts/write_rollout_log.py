"""Write a rollout log step after step with the real ``RolloutLog``, as a learner would.

Used by tests/replay/test_rollout_log.py, which kills it with SIGKILL. Prints one JSON object per line on stdout:
``{"event": "written", "step": n}`` once step n is on disk, and with ``--pause-at k``
``{"event": "write-paused", "step": k, "written": bytes}`` when the writer thread has written part of step k's
message and stops there (until killed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import pyarrow as pa

from asyncrl.config import RolloutLogConfig
from asyncrl.rollout_log import LogFiles, RolloutLog
from tests.support.rollout_log import make_batch, totals_at


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


class HalfWritten:
    """An unbuffered file that, on the step ``files`` pauses at, writes the first half of a message and stops."""

    def __init__(self, path: Path, files: PausingFiles) -> None:
        self.file = pa.OSFile(str(path), "wb")
        self.files = files
        self.closed = False

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        if self.files.step == self.files.pause_at and len(view) > 1024:
            self.file.write(view[: len(view) // 2])
            emit(event="write-paused", step=self.files.step, written=self.file.tell())
            threading.Event().wait()  # until killed
        return self.file.write(view)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self.file.close()


class PausingFiles(LogFiles):
    def __init__(self, config: RolloutLogConfig, pause_at: int) -> None:
        super().__init__(config, {"test": "kill"})
        self.pause_at = pause_at
        self.step = 0

    def write(self, record):  # type: ignore[no-untyped-def]
        self.step = record.step
        return super().write(record)

    def open_sink(self, path: Path) -> HalfWritten:
        return HalfWritten(path, self)


async def main(args: argparse.Namespace) -> None:
    config = RolloutLogConfig(args.dir, steps_per_file=args.steps_per_file, max_bytes=1 << 30)
    rollout_log = RolloutLog(PausingFiles(config, args.pause_at), max_pending_steps=1)
    try:
        for step in range(1, args.steps + 1):
            await rollout_log.record(step, step - 1, step - 1, make_batch(step, groups=8, tokens=2000), {},
                                     totals_at(step))
            if step > 1:  # with one step pending at most, the previous one is on disk now
                emit(event="written", step=step - 1)
    finally:
        await rollout_log.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--pause-at", type=int, default=0)
    p.add_argument("--steps-per-file", type=int, default=100)
    asyncio.run(main(p.parse_args()))
    sys.exit(0)
