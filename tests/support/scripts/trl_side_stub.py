"""A stand-in for TRL's side (``bench.peers.trl_side``) that needs no TRL, for tests/bench/test_trl_side.py: writes
a snapshot of two steps as ``step_clock`` would, then ends as SPEC's ``then`` says: ``sleep`` (until the parent's
timeout kills it; a child of its own sleeps too, as a colocated engine's processes would, and holds its output
open) or ``crash`` (exit 1 with no final write).

    python -m tests.support.scripts.trl_side_stub SPEC.json RESULT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.peers.trl_side import write_snapshot


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = {"trl_side": True, "pid": os.getpid(), "init_s": 0.5, "step_end_s": [1.0, 2.0]}
    if spec["then"] == "sleep":
        result["child_pid"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
    history = [{"reward": 0.25, "completions/mean_length": 10.0, "step": 1},
               {"reward": 0.5, "completions/mean_length": 14.0, "step": 2}]
    write_snapshot(result, history, spec["n"] * spec["batch_groups"], out_path)
    if spec["then"] == "sleep":
        time.sleep(600)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
