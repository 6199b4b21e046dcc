"""``make demo``'s recipe over 5 seeds and the numerics that differ between machines: does it learn everywhere?

    python -m bench.cpu.demo_seeds                 # 5 seeds + 4 perturbations of seed 0 (about 30 min on 2 cores)
    python -m bench.cpu.demo_seeds --only seed1 threads2
    python -m bench.cpu.demo_seeds --lora                # make demo ARGS=--lora over seeds 0-2 (about 15 min)

Each run is ``python -m asyncrl.examples.grpo_offpolicy`` with the demo's defaults except the one thing the run is named
for: the seed (model init, warm start, data order, sampling), 2 torch threads instead of 1 (another reduction
order), the warm start under bf16 autocast, or the warm start stopped at 25% or 35% held-out accuracy instead
of the default target. Held-out greedy accuracy (200 problems, vLLM) is read before and after RL from each
run's ``summary.json``. Target: at least +25 points in every run.

Writes ``bench/results/demo_seeds_<device>.json``: per run the accuracy before and after, the gain, samples/s
and times; over all runs the mean gain, its standard deviation and the minimum. With ``--lora``: the demo training
a LoRA adapter on the frozen warm-started policy and publishing the adapter alone, seeds 0-2, target at least +20
points in every run, into ``bench/results/demo_lora_<device>.json``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench import common

TARGET_GAIN = 0.25
LORA_TARGET_GAIN = 0.20
LORA_RUNS = {f"lora_seed{s}": ["--seed", str(s), "--lora"] for s in range(3)}
RUNS: dict[str, list[str]] = {
    **{f"seed{s}": ["--seed", str(s)] for s in range(5)},
    "threads2": ["--seed", "0", "--torch-threads", "2"],
    "warm_bf16": ["--seed", "0", "--warm-autocast", "bfloat16"],
    "warm25": ["--seed", "0", "--warm-target", "0.25"],
    "warm35": ["--seed", "0", "--warm-target", "0.35"],
}


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.parser(__doc__)
    p.add_argument("--only", nargs="*", choices=sorted(RUNS) + sorted(LORA_RUNS),
                   help="run just these (default: all)")
    p.add_argument("--lora", action="store_true", help="the LoRA demo over seeds 0-2 instead (demo_lora_<device>)")
    p.add_argument("--runs-dir", type=Path, default=common.ROOT / "runs" / "demo_seeds")
    p.add_argument("extra", nargs="*", help="more example flags for every run (after --)")
    return p.parse_args(argv)


def run_one(name: str, flags: list[str], args: Any) -> dict[str, Any]:
    out = args.runs_dir / name
    t0 = time.perf_counter()
    summary = common.run_example(name, "asyncrl.examples.grpo_offpolicy", out, [*flags, *args.extra])
    stats, warm = summary["stats"], summary["warm_start"]
    row = {"flags": flags, "before": summary["before"], "after": summary["after"],
           "gain": summary["after"] - summary["before"], "samples_per_s": stats["samples_per_s"],
           "rl_wall_s": stats["wall_s"], "warm_start_steps": warm.get("steps"),
           "warm_start_s": warm.get("seconds"), "engine_start_s": summary["engine_start_s"],
           "total_s": round(time.perf_counter() - t0, 1), "staleness_mean": summary["staleness_mean"],
           "dropped": stats["dropped"]}
    print(f"[{name}] {row['before']:.1%} -> {row['after']:.1%} ({row['gain'] * 100:+.1f} points), "
          f"{row['samples_per_s']:.0f} samples/s, {row['total_s']:.0f}s", flush=True)
    return row


def summarise(rows: dict[str, dict[str, Any]], target: float = TARGET_GAIN) -> dict[str, Any]:
    gains = [r["gain"] for r in rows.values()]
    seeds = [r["gain"] for name, r in rows.items() if name.startswith("seed")]
    return {
        "runs": rows, "target_gain": target,
        "gain_mean": statistics.fmean(gains), "gain_std": statistics.pstdev(gains), "gain_min": min(gains),
        "after_mean": statistics.fmean(r["after"] for r in rows.values()),
        "before_mean": statistics.fmean(r["before"] for r in rows.values()),
        "seed_gain_mean": statistics.fmean(seeds) if seeds else None,
        "seed_gain_std": statistics.pstdev(seeds) if seeds else None,
        "samples_per_s_mean": statistics.fmean(r["samples_per_s"] for r in rows.values()),
        "meets_target": min(gains) >= target,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs, target = (LORA_RUNS, LORA_TARGET_GAIN) if args.lora else (RUNS, TARGET_GAIN)
    result = common.Result("demo_lora" if args.lora else "demo_seeds", args, argv, module="bench.cpu.demo_seeds")
    names = args.only or list(runs)
    rows = {name: run_one(name, {**RUNS, **LORA_RUNS}[name], args) for name in names}
    out = summarise(rows, target)
    print(f"gain: mean {out['gain_mean'] * 100:.1f} (sd {out['gain_std'] * 100:.1f}), min "
          f"{out['gain_min'] * 100:.1f} points over {len(rows)} runs; target +{target * 100:.0f} in every "
          f"run: {'met' if out['meets_target'] else 'NOT met'}")
    result.write(out)


if __name__ == "__main__":
    main()
