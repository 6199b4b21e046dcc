"""``asyncrl/examples/openai_agent.py`` end to end as a user runs it (a real subprocess, the real vLLM engine, the
real openai client against asyncrl's endpoint), kept tiny: a few warm-start and RL steps prove the wiring (agent
sessions into groups, tool calls through OpenAI function calling, metrics, plot), not learning
(``bench/cpu/openai_agent.py`` measures that)."""

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
def test_openai_agent_example_trains_through_the_endpoint(tmp_path: Path) -> None:
    args = ["--hidden", "64", "--layers", "1", "--warm-steps", "40", "--warm-tool-frac", "0.9", "--steps", "3",
            "--n", "4", "--batch-groups", "2", "--eval-every", "2", "--held-out", "10", "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "asyncrl.examples.openai_agent", "--out", str(tmp_path), *args],
                          cwd=ROOT, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # starts in seconds
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "held-out greedy accuracy: before" in proc.stdout
    rows = tracking.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"loss/policy", "agent/episodes", "agent/calls_per_episode", "agent/splits"} <= set(r)
        assert r["agent/errors"] == 0 and "agent/template_mismatches" in r
    assert "eval/accuracy" in rows[1] and "eval/tool_rate" in rows[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    agent = summary["agent"]
    # Mostly tool-using warm start: episodes call the model more than once, and every episode is one trajectory
    # (the agent only appends to its history).
    assert agent["agent/calls_per_episode"] > 1 and agent["agent/splits"] == 0
    assert agent["agent/trajectories"] == agent["agent/episodes"] >= 3 * 2 * 4
    assert set(summary["dropped"]) <= {"unused_at_shutdown"}, summary["dropped"]
    assert (tmp_path / "openai_agent.png").stat().st_size > 0
