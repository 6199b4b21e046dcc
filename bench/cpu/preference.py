"""Online DPO, XPO and Nash-MD against GRPO on the demo's task, synchronous and async, over seeds.

    python -m bench.cpu.preference                       # 3 seeds x 4 trainers x 2 modes (about an hour on 2 cores)
    python -m bench.cpu.preference --seeds 0 --trainers dpo --steps 100
    python -m bench.cpu.preference --trainers dpo --modes async --pair-is   # stale pairs importance-weighted

Per seed the GRPO async run warm-starts the tiny model (``asyncrl.examples.grpo_offpolicy``); every other run of
that seed starts from the same warm-started weights (``--model``), so all eight see the same policy before RL.
The preference trainers run ``asyncrl.examples.online_dpo`` with the judge derived from the exact answer; GRPO
runs the demo with the exact-match reward. Every run trains the same number of samples (``--steps`` x 16 groups
x 8 completions); async runs use the demo's default staleness (2), synchronous ones ``--synchronous``.

Held-out greedy accuracy (200 problems, vLLM) is read before and after from each run's ``summary.json``. Goal:
Online DPO gains at least +20 points in every seed. Writes ``bench/results/preference_<device>.json`` after
every run (a cut-short run keeps what finished): per run the accuracy before and after, samples/s, the drops by
reason, and per trainer and mode the mean gain, its spread and minimum. ``--pair-is`` weights every pair by its
truncated sequence importance weight (``PreferenceConfig.is_correction``) and writes ``preference_<device>_pair_is``
instead: set beside the plain async runs, it says whether stale pairs need the weights. ``--resume FILE`` keeps
the runs an interrupted invocation finished (each row carries its own date) and runs the rest.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench import common

TRAINERS = ("grpo", "dpo", "xpo", "nash_md")
MODES = ("async", "sync")
TARGET_GAIN = 0.20  # Online DPO, every seed


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=300, help="learner steps of every run")
    p.add_argument("--runs-dir", type=Path, default=common.ROOT / "runs" / "preference",
                   help="run directories; the seeds' warm starts are looked up here")
    p.add_argument("--pair-is", action="store_true", help="preference runs weight stale pairs (--pair-is)")
    p.add_argument("--tag", default="", help="results file and run suffix (preference_<device>_<tag>)")
    p.add_argument("--resume", type=Path, help="a results file of this benchmark: its runs are kept, not run again")
    return p.parse_args(argv)


def run_one(name: str, trainer: str, mode: str, seed: int, base: Path | None, args: Any) -> dict[str, Any]:
    out = args.runs_dir / name
    module = "asyncrl.examples.grpo_offpolicy" if trainer == "grpo" else "asyncrl.examples.online_dpo"
    flags = ["--seed", str(seed), "--steps", str(args.steps), *(["--synchronous"] if mode == "sync" else []),
             *(["--trainer", trainer] if trainer != "grpo" else []), *(["--model", str(base)] if base else []),
             *(["--pair-is"] if args.pair_is and trainer != "grpo" else [])]
    t0 = time.perf_counter()
    summary = common.run_example(name, module, out, ["--tensorboard", "off", *flags])
    stats = summary["stats"]
    last = _last_metrics(out / "metrics.jsonl")
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    row = {"trainer": trainer, "mode": mode, "seed": seed, "flags": flags, "date": date, "before": summary["before"],
           "after": summary["after"], "gain": summary["after"] - summary["before"],
           "samples_trained": stats["samples_trained"], "samples_per_s": stats["samples_per_s"],
           "rl_wall_s": stats["wall_s"], "dropped": stats["dropped"], "staleness_mean": summary["staleness_mean"],
           "engine_start_s": summary["engine_start_s"], "total_s": round(time.perf_counter() - t0, 1),
           "judge": {k: v for k, v in last.items() if k.startswith("judge/")},
           "pref_last": {k: v for k, v in last.items() if k.startswith("pref/")}}
    print(f"[{name}] {row['before']:.1%} -> {row['after']:.1%} ({row['gain'] * 100:+.1f} points), "
          f"{row['samples_per_s']:.0f} samples/s, {row['total_s']:.0f}s", flush=True)
    return row


def _last_metrics(path: Path) -> dict[str, Any]:
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def summarise(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for trainer in TRAINERS:
        for mode in MODES:
            runs = [r for r in rows.values() if r["trainer"] == trainer and r["mode"] == mode]
            if not runs:
                continue
            gains = [r["gain"] for r in runs]
            table[f"{trainer}_{mode}"] = {
                "seeds": [r["seed"] for r in runs], "gains": gains, "gain_mean": statistics.fmean(gains),
                "gain_std": statistics.pstdev(gains), "gain_min": min(gains),
                "before_mean": statistics.fmean(r["before"] for r in runs),
                "after_mean": statistics.fmean(r["after"] for r in runs),
                "samples_per_s_mean": statistics.fmean(r["samples_per_s"] for r in runs)}
    dpo = [r["gain"] for r in rows.values() if r["trainer"] == "dpo"]
    return {"runs": rows, "by_trainer": table, "target_gain": TARGET_GAIN,
            "dpo_meets_target": bool(dpo) and min(dpo) >= TARGET_GAIN}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = common.Result("preference", args, argv, module="bench.cpu.preference")
    rows: dict[str, dict[str, Any]] = {}
    if args.resume is not None:  # an interrupted invocation: keep what it finished (each row has its date)
        earlier = json.loads(args.resume.read_text())
        rows = {k: {"date": earlier["date"], **v} for k, v in earlier["results"]["runs"].items()}
        print(f"resuming: {len(rows)} runs kept from {args.resume}", flush=True)
    suffix = ("_pair_is" if args.pair_is else "") + (f"_{args.tag}" if args.tag else "")
    for seed in args.seeds:
        base = args.runs_dir / f"seed{seed}_grpo_async" / "base"
        # GRPO async first: it warm-starts the seed's model, which every other run starts from
        order = [("grpo", "async")] + [(t, m) for t in TRAINERS for m in MODES if (t, m) != ("grpo", "async")]
        for trainer, mode in order:
            warm = (trainer, mode) == ("grpo", "async")
            wanted = trainer in args.trainers and mode in args.modes
            if not (warm or wanted):
                continue
            name = (f"seed{seed}_{trainer}_{mode}" + ("_pair_is" if args.pair_is and trainer != "grpo" else "")
                    + (f"_{args.tag}" if args.tag and not warm else ""))
            if name in rows or (warm and (base / "config.json").is_file() and not wanted):
                continue  # kept from the resumed file, or the seed's warm start is there already
            row = run_one(name, trainer, mode, seed, None if warm else base, args)
            if wanted:
                rows[name] = row
                result.write(summarise(rows), suffix=suffix)
    out = summarise(rows)
    for key, v in out["by_trainer"].items():
        print(f"{key}: gain {v['gain_mean'] * 100:+.1f} (sd {v['gain_std'] * 100:.1f}, min {v['gain_min'] * 100:+.1f})")
    result.write(out, suffix=suffix)


if __name__ == "__main__":
    main()
