"""TRL's side cut short keeps its steps: ``step_clock`` snapshots the run after every logged step, ``launch``
returns the snapshot of a run it killed at its timeout (``partial``), and its rates and ratios follow, kept apart
as ours are. No TRL needed: the callback gets a fake trainer state, and ``launch`` runs a stub module."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gpu.workload_rates import summarise
from bench.peers.trl_side import launch, step_clock
from bench.peers.workload_trl import trl_rates

ARGS = argparse.Namespace(batch_groups=2, n=4, skip_steps=1)
STUB = "tests.support.scripts.trl_side_stub"


def test_each_logged_step_rewrites_a_partial_snapshot(tmp_path):
    out = tmp_path / "trl_result.json"
    result = {"trl_side": True, "init_s": 3.0, "train_start": time.perf_counter()}
    clock, state = step_clock(result, str(out), per_step=8), SimpleNamespace(log_history=[])
    for step, (reward, length) in enumerate([(0.25, 10.0), (0.5, None)], 1):
        clock.on_step_end(None, state, None)
        state.log_history.append({"reward": reward, "completions/mean_length": length, "step": step})
        clock.on_log(None, state, None, logs=state.log_history[-1])
        snap = json.loads(out.read_text())
        assert snap["steps"] == step and snap["samples"] == 8 * step and snap["partial"] is True
        assert snap["step_end_s"] == result["step_end_s"] and snap["train_s"] == result["step_end_s"][-1]
    assert snap["rewards"] == [0.25, 0.5] and snap["completion_length"] == [10.0, None]
    assert snap["init_s"] == 3.0 and "train_start" not in snap
    clock.on_log(None, state, None, logs={"train_runtime": 9.0})  # the end-of-run summary: no step
    assert json.loads(out.read_text()) == snap
    assert os.listdir(tmp_path) == [out.name], "the temporary file was renamed over the result"

    rated = trl_rates(ARGS, snap)
    assert rated["partial"] is True and rated["samples"] == 16
    assert rated["samples_per_s"] == pytest.approx(16 / snap["train_s"])
    ours = {"samples_per_s": 20.0, "completion_tokens_per_s": 300.0}
    ratios = summarise({"s": {"ours": {"async": ours}, "trl": rated}})
    assert set(ratios) == {"s/async_over_trl_partial", "s/async_over_trl_partial_tokens"}


def test_a_run_killed_at_its_timeout_returns_its_snapshot(tmp_path):
    spec = {"n": 4, "batch_groups": 2, "then": "sleep"}
    res = launch(sys.executable, spec, tmp_path, "trl", paths=[], timeout=10, module=STUB, keep_partial=True)
    assert "error" not in res, res
    assert res["partial"] is True and res["cut_short"] == "TRL subprocess timed out after 10s"
    assert res["steps"] == 2 and res["samples"] == 16 and res["train_s"] == 2.0 and res["subprocess_wall_s"] >= 10
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(res["pid"], 0)
    assert gone(res["child_pid"]), "what the run started went with it"
    rated = trl_rates(ARGS, res)
    assert rated["partial"] is True and rated["samples_per_s"] == 8.0


def gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether ``pid`` is dead: no such process, or a zombie not yet reaped by init (which may be slow to). The
    kill is already sent when this is asked; the wait is for the reaping."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_snapshot_alone_is_an_error_unless_the_caller_keeps_partial_runs(tmp_path):
    spec = {"n": 4, "batch_groups": 2, "then": "crash"}  # exits before its final write
    kept = launch(sys.executable, spec, tmp_path, "trl", paths=[], timeout=60, module=STUB, keep_partial=True)
    assert kept["partial"] is True and kept["cut_short"] == "TRL subprocess exited 1" and "error" not in kept
    whole_only = launch(sys.executable, spec, tmp_path, "trl", paths=[], timeout=60, module=STUB)
    assert whole_only["error"] == "TRL subprocess exited 1 without a result" and "partial" not in whole_only
