"""``asyncrl/examples/tool_use.py`` end to end as a user runs it (a real subprocess, the real vLLM engine), kept tiny: a
few warm-start and RL steps prove the wiring (episodes, tool calls, masked loss, metrics, plot), not learning
(``bench/cpu/tool_use.py`` measures that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.examples import tracking

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_tool_use_example_runs_episodes_and_writes_metrics_plot_and_summary(tmp_path: Path) -> None:
    args = ["--hidden", "64", "--layers", "1", "--warm-steps", "30", "--warm-tool-frac", "0.5", "--steps", "3",
            "--n", "4", "--batch-groups", "2", "--eval-every", "2", "--held-out", "10", "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "asyncrl.examples.tool_use", "--out", str(tmp_path), *args], cwd=ROOT,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # starts in seconds
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "held-out greedy accuracy: before" in proc.stdout and "tool-call rate" in proc.stdout
    rows = tracking.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"loss/policy", "episode/turns_mean", "episode/tool_call_rate", "episode/env_s_mean"} <= set(r)
    assert "eval/tool_rate" in rows[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["before"]) == set(summary["after"]) == {"accuracy", "tool_rate"}
    assert (tmp_path / "tool_use.png").stat().st_size > 0
