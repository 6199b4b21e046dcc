"""Does off-policy GRPO still learn? Synchronous vs asynchronous training at the same sample budget.

    python -m bench.learning            # full: 7 settings (~15-20 min on a quiet 2-core CPU)
    python -m bench.learning --quick    # small version (~6 min)

Every setting starts from the same warm-started checkpoint (a tiny character-level Qwen2 model taught
addition by supervised teacher forcing until its held-out greedy accuracy reaches ``--warm-target``) and
trains on the same prompt order for the same number of samples (steps x groups x n):

- ``sync``: ``Pipeline.run_synchronous`` (generate a batch, train, publish; max staleness 0);
- ``async_s{1,2,4}``: ``Pipeline.run`` with max staleness 1, 2, 4 and token-level truncated importance
  weights (``is_level="token"``); ``async_s{k}_no_is``: the same without the correction (``"none"``).

One vLLM engine serves every setting: before each one, the base weights are published into it (pause ->
reload -> resume, a new version, through a ``WeightSync``) and a fresh learner (new model copy and optimiser)
starts at that version (the pipeline's version clock starts at the engine's).
This saves ~20 s of engine start-up per setting and keeps the engine identical across settings.

Held-out greedy accuracy is measured every ``--eval-every`` steps on the engine (the learner waits; the
time is excluded from the reported wall times). Writes ``learning_<device>.json`` (``learning_cpu.json``;
``_quick`` added with ``--quick``) with the common header (``bench/common.py``) and the same name with
``.png`` (accuracy vs training wall time per setting) into ``--out`` (default ``bench/results/``), and
prints a table. Tasks, the warm start and the evaluation hooks come from ``examples/common.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import common
from examples import common as ex

log = logging.getLogger("bench.learning")


@dataclass(frozen=True, slots=True)
class Setting:
    """One training regime."""

    name: str  # result key
    synchronous: bool
    max_staleness: int
    is_level: str  # "token" or "none"


# Sync and the corrected async runs go first, back to back, so load drift on a shared machine biases their
# wall-time comparison as little as possible.
SETTINGS = (
    Setting("sync", True, 0, "token"),
    Setting("async_s1", False, 1, "token"),
    Setting("async_s2", False, 2, "token"),
    Setting("async_s4", False, 4, "token"),
    Setting("async_s1_no_is", False, 1, "none"),
    Setting("async_s2_no_is", False, 2, "none"),
    Setting("async_s4_no_is", False, 4, "none"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps and a smaller held-out set")
    p.add_argument("--steps", type=int, help="learner steps per setting (default 250, quick 80)")
    p.add_argument("--n", type=int, default=8, help="group size")
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--held-out", type=int, help="held-out problems (default 400, quick 200)")
    p.add_argument("--eval-every", type=int, help="steps between held-out evaluations (default steps/10)")
    p.add_argument("--warm-target", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=[s.name for s in SETTINGS], help="run just these settings")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.steps = args.steps or (80 if args.quick else 250)
    args.held_out = args.held_out or (200 if args.quick else 400)
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    return args


# ------------------------------------------------------------------------------------------ base model


def base_checkpoint(args: argparse.Namespace, task: ex.Task) -> tuple[Path, dict[str, Any]]:
    """The warm-started model every setting starts from, cached by its recipe in ``.cache/bench``."""
    recipe = {"hidden": 128, "layers": 2, "seed": args.seed, "target": args.warm_target, "task": task.name,
              "train": len(task.train), "version": 1}

    def build(out: Path) -> dict[str, Any]:
        ex.build_char_model(out, task, recipe["hidden"], recipe["layers"], args.seed)
        result = ex.warm_start(out, task, ex.WarmStart(target=args.warm_target, seed=args.seed),
                               progress=not args.no_progress)
        return {"steps": result.steps, "accuracy_hf": result.accuracy, "seconds": result.seconds}

    return common.cached_build(common.CACHE / "learning-base", recipe, build, marker="warm_start.json", key="result")


# ------------------------------------------------------------------------------------------------ runs


def pipeline_config(args: argparse.Namespace, s: Setting) -> Any:
    import asyncrl

    b = args.batch_groups
    return asyncrl.PipelineConfig(
        producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens),
                                        max_inflight_groups=b),
        queue=asyncrl.QueueConfig(capacity=ex.queue_capacity(b, s.max_staleness), max_staleness=s.max_staleness),
        learner=asyncrl.LearnerConfig(batch_groups=b, lr=args.lr, micro_batch_rollouts=b * args.n,
                                      sync=asyncrl.SyncConfig(mode="keep")),
    )


async def run_setting(engine: Any, base: Path, tok: Any, task: ex.Task, args: argparse.Namespace,
                      s: Setting, before: float) -> dict[str, Any]:
    """Reset the engine to the base weights, train ``args.steps`` steps, measure held-out accuracy."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.recipes import grpo_pipeline

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # The base weights as the engine's next version; the new pipeline's clock starts there.
    await WeightSync(engine, VersionClock(engine.version), SyncConfig()).publish(state_dict_for_engine(model))
    torch.manual_seed(args.seed)
    pipeline = grpo_pipeline(engine, model, ex.rl_prompts(task, tok, args.seed), ex.prompt_reward(task),
                             pipeline_config(args, s), loss_config=LossConfig(is_level=s.is_level),
                             pad_id=tok.pad_token_id, close_engine=False)
    evals = ex.EvalHook(engine, tok, task, args.max_tokens, args.eval_every)
    progress = ex.ProgressHook(args.steps, desc=f"{s.name:>15}", disable=args.no_progress)
    pipeline.learner.hooks += [evals, progress]
    load_before = os.getloadavg()[0]
    try:
        run = await (pipeline.run_synchronous if s.synchronous else pipeline.run)(args.steps)
    finally:
        progress.close()
    final = evals.points[-1][1] if evals.points and evals.points[-1][0] == args.steps \
        else await evals.evaluate(args.steps)
    queue = pipeline.receiver.metrics()
    return {
        "final_accuracy": final, "wall_s": run.wall_s - evals.seconds, "mean_staleness":
        queue["rollout/staleness_mean"], "samples_trained": run.samples_trained, "steps": run.steps,
        "synchronous": s.synchronous, "max_staleness": s.max_staleness, "is_level": s.is_level,
        "wall_s_with_eval": run.wall_s, "eval_s": evals.seconds, "train_s": run.train_s,
        "sync_s": run.sync_s, "gen_s": run.gen_s, "samples_per_s": run.samples_trained /
        max(1e-9, run.wall_s - evals.seconds), "dropped": run.dropped, "unaccounted": run.unaccounted,
        "loadavg_1min": [load_before, os.getloadavg()[0]],  # before and after: other jobs skew wall times
        "curve": [{"step": 0, "accuracy": before, "wall_s": 0.0}]
        + [{"step": st, "accuracy": a, "wall_s": c} for st, a, c in evals.points],
    }


async def run_all(args: argparse.Namespace, task: ex.Task, base: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    tok = AutoTokenizer.from_pretrained(str(base))
    cfg = VLLMEngineConfig(model=str(base), dtype="float32", max_model_len=64, max_num_seqs=128, seed=args.seed)
    engine = await VLLMEngine.start(cfg)
    results: dict[str, Any] = {}
    try:
        await ex.warm_up(engine, ex.encode_prompt(tok, task.train[0].prompt),
                         pipeline_config(args, SETTINGS[0]).producer.sampling, args.batch_groups)
        before = await ex.engine_greedy_accuracy(engine, tok, task.held_out, task.reward, args.max_tokens)
        print(f"base checkpoint: held-out greedy accuracy {before:.1%} (vLLM)", flush=True)
        results["base_accuracy"] = before
        for s in SETTINGS:
            if args.only and s.name not in args.only:
                continue
            results[s.name] = await run_setting(engine, base, tok, task, args, s, before)
            r = results[s.name]
            print(f"{s.name:>15}: accuracy {r['final_accuracy']:.1%}  wall {r['wall_s']:.0f}s  "
                  f"staleness {r['mean_staleness']:.2f}  dropped {r['dropped']}", flush=True)
    finally:
        await engine.close()
    return results


# ---------------------------------------------------------------------------------------------- report


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """Per async setting: accuracy relative to sync and wall-time speed-up at equal samples."""
    sync = results.get("sync")
    out: dict[str, Any] = {}
    if not sync:
        return out
    for name, r in results.items():
        if not name.startswith("async_"):
            continue
        ratio = r["final_accuracy"] / sync["final_accuracy"] if sync["final_accuracy"] else float("nan")
        out[name] = {"accuracy_vs_sync": ratio, "speedup_vs_sync": sync["wall_s"] / r["wall_s"],
                     "meets_target": bool(ratio >= 0.95 and r["wall_s"] < sync["wall_s"])}
    return out


def table(results: dict[str, Any], verdict: dict[str, Any]) -> str:
    lines = [f"{'setting':>15} {'accuracy':>9} {'vs sync':>8} {'wall s':>7} {'speed-up':>9} {'staleness':>10} "
             f"{'samples':>8} {'dropped':>8}"]
    for s in SETTINGS:
        r = results.get(s.name)
        if r is None:
            continue
        v = verdict.get(s.name, {})
        dropped = sum(c for k, c in r["dropped"].items() if k != "unused_at_shutdown")
        lines.append(f"{s.name:>15} {r['final_accuracy']:>9.1%} {v.get('accuracy_vs_sync', 1.0):>8.2f} "
                     f"{r['wall_s']:>7.0f} {v.get('speedup_vs_sync', 1.0):>8.2f}x {r['mean_staleness']:>10.2f} "
                     f"{r['samples_trained']:>8} {dropped:>8}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {0: "black", 1: "C0", 2: "C1", 4: "C2"}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in SETTINGS:
        r = results.get(s.name)
        if r is None:
            continue
        xs = [p["wall_s"] for p in r["curve"]] + [r["wall_s"]]
        ys = [p["accuracy"] for p in r["curve"]] + [r["final_accuracy"]]
        ax.plot(xs, ys, "o-" if s.is_level != "none" else "s--", ms=3, color=colours[s.max_staleness],
                label=f"{s.name} ({r['final_accuracy']:.0%}, {r['wall_s']:.0f}s)",
                alpha=1.0 if s.is_level != "none" else 0.6)
    ax.set_xlabel("training wall time (s, held-out evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    common.set_env()
    logging.basicConfig(level=logging.WARNING)
    import torch
    import transformers

    import asyncrl

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    result = common.Result("learning", args, argv)
    task = ex.arithmetic_task(n_held_out=args.held_out, seed=args.seed)
    base, warm = base_checkpoint(args, task)
    results = asyncrl.run(run_all(args, task, base))
    verdict = verdicts(results)
    budget = args.steps * args.batch_groups * args.n
    config = {"steps": args.steps, "n": args.n, "batch_groups": args.batch_groups, "lr": args.lr,
              "max_tokens": args.max_tokens, "held_out": args.held_out, "eval_every": args.eval_every,
              "sample_budget": budget, "pause_mode": "keep", "engine": "one VLLMEngine reused; base weights "
              "republished before each setting", "settings": [asdict(s) for s in SETTINGS]}
    suffix = "_quick" if args.quick else ""
    path = result.write({**results, "verdict": verdict}, suffix=suffix, quick=args.quick, config=config,
                        warm_start=warm)
    plot(results, result.path(suffix, ".png"),
         f"GRPO on addition, {budget} samples per setting (base {results['base_accuracy']:.0%})")
    print(f"\nsame sample budget: {budget} samples ({args.steps} steps x {args.batch_groups} groups x {args.n})")
    print(table(results, verdict))
    hits = [k for k, v in verdict.items() if v["meets_target"] and not k.endswith("_no_is")]
    print(f"target (async with IS >= 95% of sync accuracy, less wall time): met by {hits or 'none'}")
    print(f"plot: {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
