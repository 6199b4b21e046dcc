"""``bench.cpu.weight_sync`` on two revisions of the code, interleaved, to tell a regression from the machine's noise.

    python -m bench.cpu.weight_sync_ab --before 73b7a0a                  # 5 MiB and 250 MiB, 2 rounds of 6 reps
    python -m bench.cpu.weight_sync_ab --before 73b7a0a --rounds 3 --sizes 5mib
    python -m bench.cpu.weight_sync_ab --before 73b7a0a --from-runs bench/results/repeats/weight_sync_ab

A single run's median of 4 reps moves by a third from run to run on a 2-core machine, so one run before and one
after a change prove nothing. This checks ``--before`` out into a temporary git worktree and runs the benchmark
there and in this tree in turn (before, after, before, after...), each run in its own process, and compares the
medians over every rep of each side: paused seconds and the ratio to vLLM's own reload measured in the same runs.
Writes ``bench/results/weight_sync_ab_<device>.json`` (every run's models included); the worktree is removed.
``--from-runs DIR`` compares result files of such runs made already (``before_*.json``, ``after_*.json``), each
written by ``python -m bench.cpu.weight_sync`` in a checkout of its revision.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import common
from bench.cpu.bench_ab import worktree


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.parser(__doc__)
    p.add_argument("--before", required=True, help="the git revision to compare this tree with")
    p.add_argument("--sizes", nargs="*", default=["5mib", "250mib"])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--from-runs", type=Path, help="compare the runs' result files found here instead of running")
    return p.parse_args(argv)


def run_side(tree: Path, args: Any, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cpu.weight_sync", "--sizes", *args.sizes, "--reps", str(args.reps),
           "--out", str(out)]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(next(out.glob("weight_sync_*.json")).read_text())


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, docs in runs.items():
        for doc in docs:
            for m in doc["results"]["models"]:
                entry = out.setdefault(m["name"], {}).setdefault(side, {"paused": [], "floor": []})
                entry["paused"] += [r["total_s"] for r in m["reps"]]
                entry["floor"] += [r["reload_floor_s"] for r in m["reps"]]
    for sides in out.values():
        for x in sides.values():
            x["paused_median_s"] = statistics.median(x["paused"])
            x["ratio_to_reload_floor"] = x["paused_median_s"] / statistics.median(x["floor"])
        sides["after_over_before_paused"] = sides["after"]["paused_median_s"] / sides["before"]["paused_median_s"]
    return out


def run_interleaved(args: Any, commit: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    """``--rounds`` rounds of (before, after), the before side in a temporary worktree of ``commit``."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-runs-") as tmp, worktree(commit) as before:
        for round_ in range(args.rounds):
            for side, tree in (("before", before), ("after", common.ROOT)):
                runs[side].append(run_side(tree, args, Path(tmp) / f"{side}-{round_}"))
                print(f"round {round_ + 1}: {side} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = common.Result("weight_sync_ab", args, argv, module="bench.cpu.weight_sync_ab")
    commit = subprocess.run(["git", "rev-parse", args.before], cwd=common.ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    if args.from_runs is not None:
        for side in runs:
            runs[side] = [json.loads(p.read_text()) for p in sorted(args.from_runs.glob(f"{side}_*.json"))]
    else:
        run_interleaved(args, commit, runs)
    summary = compare(runs)
    for name, sides in summary.items():
        print(f"{name}: paused {sides['before']['paused_median_s'] * 1e3:.1f} ms before, "
              f"{sides['after']['paused_median_s'] * 1e3:.1f} ms after ({sides['after_over_before_paused']:.2f}x); "
              f"ratio to reload {sides['before']['ratio_to_reload_floor']:.2f} -> "
              f"{sides['after']['ratio_to_reload_floor']:.2f}")
    result.write({"before_commit": commit, "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
