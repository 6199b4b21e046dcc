"""The package's console scripts (pyproject.toml ``[project.scripts]``: the examples' and ``asyncrl``, the replay
tools) are installed, and ``--help`` of each exits 0 and names what the program needs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {  # script -> what its --help must mention
    "asyncrl-grpo": ["--steps"],
    "asyncrl-tool-use": ["--steps"],
    "asyncrl-online-dpo": ["--trainer"],
    "asyncrl-openai-agent": ["--steps"],
    "asyncrl-distributed-grpo": ["--servers"],
    "asyncrl-embedded-service": ["ASYNCRL_TOKEN", "JSON lines on stdout"],
    "asyncrl-remote-learner": ["ASYNCRL_TOKEN", "JSON lines on stdout"],
    "asyncrl": ["replay", "plot"],
}


def test_every_script_is_declared() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(declared) == set(SCRIPTS)


@pytest.mark.timeout(120)
def test_each_script_answers_help_and_names_its_environment() -> None:
    bin_dir = Path(sys.executable).parent
    missing = [name for name in SCRIPTS if not (bin_dir / name).exists()]
    assert not missing, f"{missing} not installed in {bin_dir}: reinstall (pip install --no-deps -e .)"
    running = {name: subprocess.Popen([str(bin_dir / name), "--help"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name in SCRIPTS}
    for name, proc in running.items():  # all at once: each start imports torch
        out, err = proc.communicate(timeout=110)
        assert proc.returncode == 0, f"{name} --help: exit {proc.returncode}\n{err[-2000:]}"
        assert out.startswith(f"usage: {name}"), out[:200]
        flat = " ".join(out.split())  # argparse wraps the epilog
        for needed in SCRIPTS[name]:
            assert needed in flat, f"{name} --help does not mention {needed}:\n{out}"
