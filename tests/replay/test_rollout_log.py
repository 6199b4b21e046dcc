"""The rollout log on its own: what is written reads back exactly, a torn tail is discarded, the size bound holds,
a resumed run's steps replace the old ones, the writer pushes back instead of dropping, and a writer killed with
SIGKILL mid-write (a real child process) leaves only whole steps."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncrl.config import RolloutLogConfig
from asyncrl.rollout_log import LogFiles, RolloutLog, RolloutLogError, header, log_files, read, read_table
from asyncrl.types import DropReason
from tests.support.rollout_log import make_batch, totals_at
from tests.support.scripts import write_rollout_log

async def write_steps(directory: Path, steps: range, **config: object) -> RolloutLog:
    rollout_log = RolloutLog.open(RolloutLogConfig(directory, **config), {"run": "test"})
    try:
        for step in steps:
            if step % 2 == 0:
                rollout_log.dropped(DropReason.STALE, make_batch(step + 1000, groups=1))
            await rollout_log.record(step, step - 1, step - 2, make_batch(step), {"loss/total": step / 3},
                                     totals_at(step))
    finally:
        await rollout_log.aclose()
    return rollout_log


async def test_every_step_reads_back_exactly_with_its_drops_and_metrics(tmp_path):
    await write_steps(tmp_path, range(1, 8), steps_per_file=3)
    assert [f.first_step for f in log_files(tmp_path)] == [1, 4, 7], "a file per steps_per_file steps"
    steps = list(read(tmp_path))
    assert [s.step for s in steps] == list(range(1, 8))
    for s in steps:
        assert s.groups == tuple(make_batch(s.step)), "token ids, log-probs, spans, masks, companions: exact"
        assert (s.policy_version, s.served_version, s.metrics) == (s.step - 1, s.step - 2, {"loss/total": s.step / 3})
        assert s.drops == ({DropReason.STALE: 1} | ({DropReason.REWARD_ERROR: 1} if s.step % 3 == 0 else {}))
        assert s.dropped == ((("s%d-g0" % (s.step + 1000), DropReason.STALE),) if s.step % 2 == 0 else ())
    assert header(tmp_path)["run"] == "test"
    table = read_table(tmp_path)
    assert table.num_rows == 7 * 2 * 4 and table.column("step").to_pylist()[::8] == list(range(1, 8))
    assert list(read(tmp_path, start=5))[0].step == 5


async def test_a_torn_tail_is_discarded_at_every_cut(tmp_path, caplog):
    await write_steps(tmp_path, range(1, 5), steps_per_file=10)
    [file] = log_files(tmp_path)
    data = file.path.read_bytes()
    cuts = 0
    for cut in range(0, len(data), 97):
        file.path.write_bytes(data[:cut])
        got = [s.step for s in read(tmp_path)]
        assert got == list(range(1, len(got) + 1)), f"cut at {cut}: {got}"
        cuts += len(got) < 4
    assert cuts > 10 and "discarded a torn step" in caplog.text


async def test_the_size_bound_holds_after_every_step(tmp_path):
    bound = 256 * 1024
    rollout_log = RolloutLog.open(RolloutLogConfig(tmp_path, steps_per_file=100, max_bytes=bound), {})
    sizes = []
    for step in range(1, 41):
        await rollout_log.record(step, step - 1, step - 1, make_batch(step, groups=4, tokens=100), {},
                                 totals_at(step))
        await rollout_log.aclose()  # every step on disk before it is measured
        sizes.append(sum(f.path.stat().st_size for f in log_files(tmp_path)))
    assert max(sizes) <= bound and sizes[-1] > bound / 2, sizes
    assert len(log_files(tmp_path)) > 1, "rotated into several files"
    steps = [s.step for s in read(tmp_path)]
    assert steps[-1] == 40 and steps[0] > 1, "the oldest steps were deleted"
    assert steps == list(range(steps[0], 41)), "what is left is contiguous"


async def test_a_step_over_the_bound_fails_the_run_rather_than_being_dropped(tmp_path):
    rollout_log = RolloutLog.open(RolloutLogConfig(tmp_path, max_bytes=64 * 1024), {})
    await rollout_log.record(1, 0, 0, make_batch(1, groups=8, tokens=2000), {}, totals_at(1))
    with pytest.raises(RolloutLogError, match="max_bytes"):
        await rollout_log.aclose()


async def test_a_resumed_run_s_steps_replace_the_earlier_ones(tmp_path):
    await write_steps(tmp_path, range(1, 9), steps_per_file=3)  # killed at step 8, its checkpoint at step 4
    await write_steps(tmp_path, range(5, 7), steps_per_file=3)  # resumed from step 4, stopped at 6
    steps = list(read(tmp_path))
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6], "steps 7-8 of the killed run are not the resumed run's"
    assert [f.segment for f in log_files(tmp_path)][-1] == 2


class Gated(LogFiles):
    """Files whose writes wait for ``gate``: a writer thread that fell behind."""

    def __init__(self, config: RolloutLogConfig) -> None:
        super().__init__(config, {})
        self.gate = threading.Event()

    def write(self, record):  # type: ignore[no-untyped-def]
        assert self.gate.wait(30)
        return super().write(record)


async def test_a_slow_writer_pushes_back_without_blocking_the_loop_or_dropping(tmp_path):
    files = Gated(RolloutLogConfig(tmp_path))
    rollout_log = RolloutLog(files, max_pending_steps=2)
    for step in (1, 2):
        await asyncio.wait_for(rollout_log.record(step, 0, 0, make_batch(step), {}, totals_at(step)), 5)
    third = asyncio.create_task(rollout_log.record(3, 0, 0, make_batch(3), {}, totals_at(3)))
    ticks = 0
    for _ in range(20):  # the loop runs on while the third step waits for room
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 20 and not third.done(), "the third step waits for the writer (backpressure)"
    files.gate.set()
    await asyncio.wait_for(third, 30)
    await rollout_log.aclose()
    assert [s.step for s in read(tmp_path)] == [1, 2, 3]
    assert rollout_log.wait_s > 0


async def test_closing_while_cancelled_still_writes_what_was_handed_over(tmp_path):
    files = Gated(RolloutLogConfig(tmp_path))
    rollout_log = RolloutLog(files, max_pending_steps=4)
    await rollout_log.record(1, 0, 0, make_batch(1), {}, totals_at(1))

    async def run() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await rollout_log.aclose()

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    task.cancel()
    files.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [s.step for s in read(tmp_path)] == [1]
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncrl-rollout-log")]


def test_a_writer_killed_mid_write_leaves_only_whole_steps(tmp_path, caplog):
    # Run as a module from the checkout, so the script finds ``tests.support`` wherever the suite runs.
    proc = subprocess.Popen([sys.executable, "-m", write_rollout_log.__name__, "--dir", str(tmp_path / "log"),
                             "--pause-at", "6", "--steps-per-file", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "write-paused":
                break
        assert events and events[-1]["event"] == "write-paused", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    torn = log_files(tmp_path / "log")[-1].path
    assert torn.stat().st_size == events[-1]["written"], "the kill left part of step 6 in the file"
    with caplog.at_level(logging.WARNING):
        steps = list(read(tmp_path / "log"))
    assert [s.step for s in steps] == [1, 2, 3, 4, 5], "whole steps, none torn"
    assert all(s.groups == tuple(make_batch(s.step, groups=8, tokens=2000)) for s in steps)
    assert "discarded a torn step" in caplog.text
    assert read_table(tmp_path / "log").num_rows == 5 * 8 * 4
