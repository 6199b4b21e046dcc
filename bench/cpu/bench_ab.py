"""A benchmark on two revisions of the code, interleaved in one run, to tell a regression from the machine's noise.

    python -m bench.cpu.bench_ab --bench queue_micro --before 1d611fb --rounds 3 -- --quick
    python -m bench.cpu.bench_ab --bench engine_limit --before-tree /path/to/old/checkout --rounds 2

The ``--before`` side runs in a temporary git worktree of that revision (or in ``--before-tree``, a checkout made
beforehand: the GPU host gets no git history), the after side in this tree; they alternate (before, after, before,
after...), each run in its own process, with the arguments after ``--``. For each figure the bench reports, the
median of each side's runs and the after/before ratio. Writes ``bench/results/ab_<bench>_<device>.json`` with every
run's result file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import common

# The figures compared, per bench: paths into its result file's "results".
FIGURES = {
    "queue_micro": ("rollouts_per_s", "rollouts_per_cpu_s", "p50_ms", "p99_ms"),
    "engine_limit": ("ratio", "raw_tokens_per_s", "pipe_tokens_per_s", "main_cpu_us_per_token"),
}


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.parser(__doc__)
    p.add_argument("--bench", choices=sorted(FIGURES), required=True)
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--before", help="the git revision to compare this tree with")
    side.add_argument("--before-tree", type=Path, help="a checkout of the earlier revision")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("bench_args", nargs="*", help="arguments for the bench (after --)")
    return p.parse_args(argv)


@contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """A temporary, detached git worktree of ``commit``, removed on the way out."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-") as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), commit], cwd=common.ROOT, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=common.ROOT, check=False)


def run_side(tree: Path, bench: str, bench_args: list[str], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", f"bench.cpu.{bench}", *bench_args, "--out", str(out)]
    # The side's own asyncrl first, also in the processes it starts (then whatever the path held: a site of vLLM).
    env_path = {"PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env_path})
    return json.loads(next(out.glob(f"{bench}_*.json")).read_text())


def compare(bench: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIGURES[bench]:
        sides = {side: statistics.median(doc["results"][name] for doc in docs) for side, docs in runs.items()}
        out[name] = {**sides, "after_over_before": sides["after"] / sides["before"] if sides["before"] else None}
    return out


def interleaved(args: Any, before: Path, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for side, tree in (("before", before), ("after", common.ROOT)):
            runs[side].append(run_side(tree, args.bench, args.bench_args, tmp / f"{side}-{round_}"))
            print(f"round {round_ + 1}: {side} done", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = common.Result(f"ab_{args.bench}", args, argv, module="bench.cpu.bench_ab")
    with tempfile.TemporaryDirectory(prefix="asyncrl-ab-runs-") as tmp:
        if args.before_tree is not None:
            runs, before = interleaved(args, args.before_tree.resolve(), Path(tmp)), str(args.before_tree)
        else:
            before = subprocess.run(["git", "rev-parse", args.before], cwd=common.ROOT, check=True,
                                    capture_output=True, text=True).stdout.strip()
            with worktree(before) as tree:
                runs = interleaved(args, tree, Path(tmp))
    summary = compare(args.bench, runs)
    for name, s in summary.items():
        print(f"{name}: before {s['before']:.4g}, after {s['after']:.4g} (after/before {s['after_over_before']:.3f})")
    result.write({"before": before, "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
