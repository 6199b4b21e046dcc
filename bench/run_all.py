"""Run every benchmark, each in its own subprocess (``make bench``; ``make bench ARGS=--quick``).

    python -m bench.run_all [--quick] [--only NAME ...] [--skip NAME ...] [--out DIR]

Order: queue_micro (no vLLM), engine_limit, weight_sync, async_vs_sync, contention, vs_trl, learning,
tool_use, openai_agent, scaling_sim (needs Ray: ``pip install -e '.[ray]'``), demo_seeds (the longest, ~45 min).
Each runs as
``python -m bench.<kind>.<name>`` from the repository root (kind ``cpu``; ``peers`` for vs_trl). ``--quick`` is
passed to each (as a smaller run for the ones without that flag); vs_trl also gets ``--setup-trl`` (it builds TRL's
venv in ``.cache/trl-venv`` when missing).
Each writes ``<name>_<device>.json`` into ``--out`` (default ``bench/results/``); a benchmark that fails is
reported and the others still run. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ORDER = ("queue_micro", "engine_limit", "weight_sync", "async_vs_sync", "contention", "vs_trl", "learning",
         "tool_use", "openai_agent", "scaling_sim", "demo_seeds")
KIND = {"vs_trl": "peers"}  # the package each runs from: bench.cpu unless named here
EXTRA = {"vs_trl": ["--setup-trl"]}  # on a fresh machine, vs_trl creates TRL's own venv first
QUICK = {"tool_use": ["--seeds", "0", "--steps", "30"],
         "openai_agent": ["--seeds", "0", "--steps", "20", "--rounds", "1"],
         "demo_seeds": ["--only", "seed0"]}  # no --quick flag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="passed to every benchmark")
    p.add_argument("--only", nargs="*", choices=ORDER, help="run just these")
    p.add_argument("--skip", nargs="*", choices=ORDER, default=[], help="leave these out")
    p.add_argument("--out", type=Path, help="passed to every benchmark: where result files go "
                                            "(default: each benchmark's, bench/results)")
    args = p.parse_args(argv)
    names = [n for n in ORDER if (BENCH / KIND.get(n, "cpu") / f"{n}.py").exists() and (not args.only or n in args.only)
             and n not in args.skip]
    failed: list[str] = []
    times: dict[str, float] = {}
    for name in names:
        quick = QUICK.get(name, ["--quick"]) if args.quick else []
        cmd = [sys.executable, "-m", f"bench.{KIND.get(name, 'cpu')}.{name}", *quick,
               *(["--out", str(args.out)] if args.out else []), *EXTRA.get(name, [])]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        times[name] = time.perf_counter() - t0
        if rc != 0:
            failed.append(name)
            print(f"=== {name} FAILED (exit {rc})", flush=True)
    print("\n=== summary")
    for name in names:
        print(f"  {name:<14} {'FAILED' if name in failed else 'ok':<7} {times[name]:>6.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
