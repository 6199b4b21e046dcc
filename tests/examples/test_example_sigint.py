"""Ctrl-C or SIGTERM in the example: either, mid-training, ends the script and every child process within 10 s
and leaves none of the engine's socket files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wait_for_line(proc: subprocess.Popen[str], needle: str, deadline_s: float) -> list[str]:
    seen: list[str] = []
    end = time.monotonic() + deadline_s
    assert proc.stdout is not None
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not printed within {deadline_s}s; output:\n{''.join(seen)[-3000:]}")


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_ctrl_c_mid_training_stops_script_and_children_within_10s(tmp_path: Path, sig: int, said: str) -> None:
    args = [sys.executable, "-m", "asyncrl.examples.grpo_offpolicy", "--out", str(tmp_path / "run"), "--hidden", "64",
            "--layers", "1",
            "--warm-max-steps", "5", "--steps", "100000", "--n", "4", "--batch-groups", "2", "--eval-every", "0",
            "--held-out", "10", "--tensorboard", "off", "--no-progress"]
    # Where the engine's socket directory goes (asyncrl.engines.rpc_dir); short: a socket path has 107 bytes.
    rpc = Path(tempfile.mkdtemp(prefix="sig-"))
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(rpc)}
    # As a context manager, Popen closes the output pipe and reaps the script however the test ends.
    with subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as proc:
        try:
            _wait_for_line(proc, "held-out greedy accuracy before RL", deadline_s=240)
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            assert len(family) > 1, "the engine runs in child processes"
            t0 = time.monotonic()
            proc.send_signal(sig)
            gone, alive = psutil.wait_procs(family, timeout=10)
            alive = [p for p in alive if _running(p)]  # exited children of exited parents stay zombies here
            elapsed = time.monotonic() - t0
            assert not alive, f"still running {elapsed:.1f}s after {sig!r}: {[p.pid for p in alive]}"
            out = proc.stdout.read() if proc.stdout else ""
            assert said in out, out[-2000:]
            assert not list(rpc.iterdir()), "the engine's socket directory was left behind"
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(rpc, ignore_errors=True)
