"""Does multi-turn GRPO teach a tiny model to use a tool? Held-out accuracy before and after RL, over seeds.

    python -m bench.cpu.tool_use                                  # 3 seeds (~10 min on a quiet 2-core CPU)
    python -m bench.cpu.tool_use --seeds 0 --steps 10 --warm-steps 200 --held-out 50 --out /tmp/bench   # smoke

Each seed runs ``asyncrl/examples/tool_use.py`` end to end: a character-level model with calculator tokens is built and
warm-started on a mix of tool-using and direct demonstrations (``--warm-tool-frac`` use the tool), then trained
with GRPO on whole episodes (the model writes ``<calc>a*b</calc>``, the environment appends the product as
environment tokens, the model answers). Held-out greedy accuracy and the share of held-out episodes that call
the tool are measured before and after RL, through the same episode runner. Writes ``tool_use_<device>.json``
into ``--out`` with the common header (``bench/common.py``): per seed, and mean / min / max over seeds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from typing import Any

from bench import common
from asyncrl.examples import calculator, tool_use, tracking

log = logging.getLogger("bench.cpu.tool_use")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100, help="learner steps per seed")
    p.add_argument("--warm-steps", type=int, default=800)
    p.add_argument("--warm-tool-frac", type=float, default=0.25)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-staleness", type=int, default=2)
    return p.parse_args(argv)


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One end-to-end run of the example (its own model, engine and data order)."""
    import asyncrl

    out = common.CACHE / "tool_use" / f"seed{seed}"
    ex = tool_use.parse_args([
        "--out", str(out), "--seed", str(seed), "--steps", str(args.steps), "--warm-steps", str(args.warm_steps),
        "--warm-tool-frac", str(args.warm_tool_frac), "--held-out", str(args.held_out), "--n", str(args.n),
        "--batch-groups", str(args.batch_groups), "--lr", str(args.lr), "--max-staleness", str(args.max_staleness),
        "--eval-every", "0", "--no-progress",
    ])
    out.mkdir(parents=True, exist_ok=True)
    task = calculator.multiplication_task(n_held_out=ex.held_out, seed=seed)
    model_dir, warm = tool_use.prepare_model(ex, task)
    result = asyncrl.run(tool_use.main(ex, task, model_dir))
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    last = rows[-1] if rows else {}
    return {"seed": seed, "warm_start_s": warm["seconds"], "rl_wall_s": result["wall_s"], "steps": result["steps"],
            "accuracy_before": result["before"]["accuracy"], "accuracy_after": result["after"]["accuracy"],
            "tool_rate_before": result["before"]["tool_rate"], "tool_rate_after": result["after"]["tool_rate"],
            "sampled_tool_rate_end": last.get("episode/tool_call_rate"),
            "train_reward_end": last.get("train/reward_mean"), "dropped": result["dropped"]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("accuracy_before", "accuracy_after", "tool_rate_before", "tool_rate_after", "rl_wall_s"):
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    out["learns_to_use_the_tool"] = all(r["tool_rate_after"] > r["tool_rate_before"] and
                                        r["accuracy_after"] > r["accuracy_before"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    result = common.Result("tool_use", args, argv, module="bench.cpu.tool_use")
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(args, seed))
        r = runs[-1]
        print(f"seed {seed}: accuracy {r['accuracy_before']:.1%} -> {r['accuracy_after']:.1%}, tool-call rate "
              f"{r['tool_rate_before']:.1%} -> {r['tool_rate_after']:.1%} ({r['rl_wall_s']:.0f}s of RL)", flush=True)
    summary = summarise(runs)
    print(f"mean over {len(runs)} seeds: accuracy {summary['accuracy_before']['mean']:.1%} -> "
          f"{summary['accuracy_after']['mean']:.1%}, tool-call rate {summary['tool_rate_before']['mean']:.1%} -> "
          f"{summary['tool_rate_after']['mean']:.1%}")
    result.write({"summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
