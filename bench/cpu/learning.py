"""Does off-policy GRPO still learn? Synchronous vs asynchronous training at the same sample budget.

    python -m bench.cpu.learning            # full: 10 settings x 3 seeds (~40 min on a quiet 2-core CPU)
    python -m bench.cpu.learning --quick    # small version, one seed

Every setting starts from the same warm-started checkpoint (a tiny character-level Qwen2 model taught
addition by supervised teacher forcing until its held-out greedy accuracy reaches ``--warm-target``) and
trains on the same prompt order for the same number of samples (steps x groups x n):

- ``sync``: ``Pipeline.run_synchronous`` (generate a batch, train, publish; max staleness 0);
- ``async_s{1,2,4,8}``: ``Pipeline.run`` with staleness-aware admission (``QueueConfig.admission``) at max
  staleness 1, 2, 4, 8, token-level truncated importance weights (``correction="truncate"``) and one batch of
  queue capacity, so producers run at most that far ahead of the learner and the bound is a ceiling;
- ``async_s{4,8}_full`` and ``async_s{4,8}_full_m2po``: the queue sized to the bound (``batch_groups x max(1, s -
  1)``), so that every group is trained at the bound here (generation outpaces the learner), with truncation and
  with M2PO's second-moment mask: what the corrections do with data that stale;
- ``async_s4_no_admission``: the old rule (no admission: finish order, stale groups dropped; truncation);
- opt-in rows, run only when named in ``--only``: masked importance sampling (``async_s{4,8}_full_mis``, and
  ``async_s4_full_mis_seq`` at sequence level), ``async_s2_no_admission`` and ``async_s{1,2,4}_no_is`` (no
  importance weight at all), e.g. ``--only sync async_s4_full_mis``.

Besides the final held-out accuracy, each run records ``last3_accuracy`` (the mean of the last three
evaluations, a less noisy estimate of where the run ended), the groups dropped by reason, the tokens generated,
and ``step_means``: per-step gauges averaged over the run (importance weights capped or masked, token staleness,
trained against generated mean length).

One vLLM engine serves every setting: before each one, the base weights are published into it (pause ->
reload -> resume, a new version, through a ``WeightSync``) and a fresh learner (new model copy and optimiser)
starts at that version (the pipeline's version clock starts at the engine's).
This saves ~20 s of engine start-up per setting and keeps the engine identical across settings.

Every setting runs once per seed (``--seeds``; each seed its own warm-started model, data order and held-out
set); verdicts are taken on the mean over seeds, with the spread shown. Held-out greedy accuracy is measured
every ``--eval-every`` steps on the engine (the learner waits; the time is excluded from the reported wall
times). Writes ``learning_<device>.json`` (``learning_cpu.json``;
``_quick`` added with ``--quick``) with the common header (``bench/common.py``) and the same name with
``.png`` (accuracy vs training wall time per setting) into ``--out`` (default ``bench/results/``), and
prints a table. Tasks, the warm start and the evaluation hooks come from ``asyncrl/examples/`` (``common``, ``sft``,
``tracking``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import common
from asyncrl.data import encode_prompt
from asyncrl.examples import common as ex
from asyncrl.examples import sft, tracking

log = logging.getLogger("bench.cpu.learning")


@dataclass(frozen=True, slots=True)
class Setting:
    """One training regime."""

    name: str  # result key
    synchronous: bool
    max_staleness: int
    is_level: str  # "token", "sequence" or "none"
    correction: str = "truncate"  # LossConfig.correction: "truncate", "mask" or "m2po"
    admission: bool = True  # QueueConfig.admission
    capacity: str = "batch"  # queue capacity: "batch" (batch_groups) or "bound" (batch_groups x max(1, s - 1))
    opt_in: bool = False  # runs only when named in --only


# Sync and the async runs go first, back to back, so load drift on a shared machine biases their wall-time
# comparison as little as possible. Every async row runs with staleness-aware admission unless it says otherwise.
# "batch" rows hold one batch in the queue: the gate lets producers run at most that far ahead of the learner, so
# the bound is a ceiling that long groups may reach. "_full" rows size the queue to the bound (batch_groups x
# max(1, s - 1), the old rule), so that, generation outpacing the learner here, every group is trained at the
# bound: they show what each correction does with data that stale.
SETTINGS = (
    Setting("sync", True, 0, "token"),
    Setting("async_s1", False, 1, "token"),
    Setting("async_s2", False, 2, "token"),
    Setting("async_s4", False, 4, "token"),
    Setting("async_s8", False, 8, "token"),
    Setting("async_s4_full", False, 4, "token", capacity="bound"),
    Setting("async_s4_full_m2po", False, 4, "token", "m2po", capacity="bound"),
    Setting("async_s8_full", False, 8, "token", capacity="bound"),
    Setting("async_s8_full_m2po", False, 8, "token", "m2po", capacity="bound"),
    # The old rule: no admission (start whenever there is room, train in finish order, drop what is too stale).
    Setting("async_s4_no_admission", False, 4, "token", admission=False, capacity="bound"),
    Setting("async_s4_full_mis", False, 4, "token", "mask", capacity="bound", opt_in=True),
    Setting("async_s8_full_mis", False, 8, "token", "mask", capacity="bound", opt_in=True),
    Setting("async_s4_full_mis_seq", False, 4, "sequence", "mask", capacity="bound", opt_in=True),
    Setting("async_s2_no_admission", False, 2, "token", admission=False, capacity="bound", opt_in=True),
    Setting("async_s1_no_is", False, 1, "none", opt_in=True),
    Setting("async_s2_no_is", False, 2, "none", opt_in=True),
    Setting("async_s4_no_is", False, 4, "none", opt_in=True),
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
    p.add_argument("--seeds", type=int, nargs="+", help="one run of every setting per seed (default 0 1 2; "
                   "quick: 0)")
    p.add_argument("--reward", choices=("exact", "digits"), default="exact", help="RL reward (see the example)")
    p.add_argument("--only", nargs="*", choices=[s.name for s in SETTINGS],
                   help="run just these settings (the only way to run the opt-in rows)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.steps = args.steps or (80 if args.quick else 250)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.held_out = args.held_out or (200 if args.quick else 400)
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    return args


# ------------------------------------------------------------------------------------------ base model


def base_checkpoint(args: argparse.Namespace, task: ex.Task, seed: int) -> tuple[Path, dict[str, Any]]:
    """The warm-started model every setting of ``seed`` starts from, cached by its recipe in ``.cache/bench``."""
    recipe = {"hidden": 128, "layers": 2, "seed": seed, "target": args.warm_target, "task": task.name,
              "train": len(task.train), "version": 1}

    def build(out: Path) -> dict[str, Any]:
        sft.build_char_model(out, task, recipe["hidden"], recipe["layers"], seed)
        result = sft.warm_start(out, task, sft.WarmStart(target=args.warm_target, seed=seed),
                               progress=not args.no_progress)
        return {"steps": result.steps, "accuracy_hf": result.accuracy, "seconds": result.seconds}

    return common.cached_build(common.CACHE / "learning-base", recipe, build, marker="warm_start.json", key="result")


# ------------------------------------------------------------------------------------------------ runs


def pipeline_config(args: argparse.Namespace, s: Setting) -> Any:
    import asyncrl

    b = args.batch_groups
    return asyncrl.PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens),
                                        max_inflight_groups=b),
        queue=asyncrl.QueueConfig(capacity=b if s.capacity == "batch" else ex.queue_capacity(b, s.max_staleness),
                                  max_staleness=s.max_staleness,
                                  admission=s.admission),
        learner=asyncrl.LearnerConfig(batch_groups=b, lr=args.lr, micro_batch_rollouts=b * args.n,
                                      sync=asyncrl.SyncConfig(mode="keep")),
    )


async def run_setting(engine: Any, base: Path, tok: Any, task: ex.Task, args: argparse.Namespace,
                      s: Setting, before: float, seed: int) -> dict[str, Any]:
    """Reset the engine to the base weights, train ``args.steps`` steps, measure held-out accuracy."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.groups import RewardGroups
    from asyncrl.recipes import grpo_pipeline

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # The base weights as the engine's next version; the new pipeline's clock starts there.
    await WeightSync(engine, VersionClock(engine.version), SyncConfig()).publish(state_dict_for_engine(model))
    torch.manual_seed(seed)
    pipeline = grpo_pipeline(engine, model, ex.rl_prompts(task, tok, seed), RewardGroups(ex.prompt_reward(task)),
                             pipeline_config(args, s),
                             loss_config=LossConfig(is_level=s.is_level, correction=s.correction),
                             pad_id=tok.pad_token_id, close_engine=False)
    evals = tracking.EvalHook(engine, tok, task, args.max_tokens, args.eval_every)
    telemetry = MeanOfSteps(TELEMETRY)
    progress = tracking.ProgressHook(args.steps, desc=f"{s.name:>15}", disable=args.no_progress)
    pipeline.learner.hooks += [evals, telemetry, progress]
    load_before = os.getloadavg()[0]
    try:
        run = await (pipeline.run_synchronous if s.synchronous else pipeline.run)(args.steps)
    finally:
        progress.close()
    final = evals.points[-1][1] if evals.points and evals.points[-1][0] == args.steps \
        else await evals.evaluate(args.steps)
    queue = pipeline.receiver.metrics()
    return {
        "final_accuracy": final, "last3_accuracy": statistics.fmean([a for _, a, _ in evals.points[-3:]] or [final]),
        "wall_s": run.wall_s - evals.seconds, "mean_staleness":
        queue["rollout/staleness_mean"], "samples_trained": run.samples_trained, "steps": run.steps,
        "synchronous": s.synchronous, "max_staleness": s.max_staleness, "is_level": s.is_level,
        "correction": s.correction, "admission": s.admission, "groups_trained": run.groups_trained,
        "tokens_generated": run.tokens_generated, "step_means": telemetry.means(),
        "wall_s_with_eval": run.wall_s, "eval_s": evals.seconds, "train_s": run.train_s,
        "sync_s": run.sync_s, "gen_s": run.gen_s, "samples_per_s": run.samples_trained /
        max(1e-9, run.wall_s - evals.seconds), "dropped": run.dropped, "unaccounted": run.unaccounted,
        "loadavg_1min": [load_before, os.getloadavg()[0]],  # before and after: other jobs skew wall times
        "curve": [{"step": 0, "accuracy": before, "wall_s": 0.0}]
        + [{"step": st, "accuracy": a, "wall_s": c} for st, a, c in evals.points],
    }


async def run_all(args: argparse.Namespace, bases: dict[int, tuple[ex.Task, Path]]) -> dict[str, Any]:
    """Every setting for every seed, on one engine (each seed's base weights published before each run)."""
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    first = bases[args.seeds[0]][1]
    tok = AutoTokenizer.from_pretrained(str(first))
    cfg = VLLMEngineConfig(model=str(first), dtype="float32", max_model_len=64, max_num_seqs=128,
                           seed=args.seeds[0])
    engine = await VLLMEngine.start(cfg)
    runs: dict[str, dict[int, Any]] = {}
    befores: dict[int, float] = {}
    try:
        await ex.warm_up(engine, encode_prompt(bases[args.seeds[0]][0].train[0].prompt, tok),
                         pipeline_config(args, SETTINGS[0]).producer.sampling, args.batch_groups)
        for seed in args.seeds:
            task, base = bases[seed]
            befores[seed] = await base_accuracy(engine, base, tok, task, args)
            for s in SETTINGS:
                if (s.name in args.only) if args.only else not s.opt_in:
                    r = await run_setting(engine, base, tok, task, args, s, befores[seed], seed)
                    runs.setdefault(s.name, {})[seed] = r
                    print(f"seed {seed} {s.name:>15}: accuracy {r['final_accuracy']:.1%}  wall {r['wall_s']:.0f}s"
                          f"  staleness {r['mean_staleness']:.2f}  dropped {r['dropped']}", flush=True)
    finally:
        await engine.close()
    return {"base_accuracy": befores, **{name: aggregate(by_seed) for name, by_seed in runs.items()}}


async def base_accuracy(engine: Any, base: Path, tok: Any, task: ex.Task, args: argparse.Namespace) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.engines.weights import state_dict_for_engine

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    await WeightSync(engine, VersionClock(engine.version), SyncConfig()).publish(state_dict_for_engine(model))
    before = await tracking.engine_greedy_accuracy(engine, tok, task.held_out, task.reward, args.max_tokens, "base")
    print(f"base checkpoint {base.name}: held-out greedy accuracy {before:.1%} (vLLM)", flush=True)
    return before


# Per-step gauges averaged over a run: where the correction bites, how stale the tokens were, and whether the
# trained completions kept the generated length distribution.
TELEMETRY = ("loss/is_trunc_frac", "loss/is_masked_frac", "loss/is_weight_mean", "loss/staleness_mean",
             "loss/staleness_max", "length/trained_mean", "length/generated_mean", "rollout/staleness_batch_mean")


class MeanOfSteps:
    """A learner hook: the mean over steps of each named metric the steps reported."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.sums = dict.fromkeys(names, 0.0)
        self.counts = dict.fromkeys(names, 0)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        for name in self.sums:
            if name in metrics:
                self.sums[name] += float(metrics[name])
                self.counts[name] += 1

    def means(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in self.sums if self.counts[name]}


def aggregate(by_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean and population standard deviation over seeds of the figures verdicts are taken on."""
    out: dict[str, Any] = {"seeds": by_seed}
    for key in ("final_accuracy", "last3_accuracy", "wall_s", "mean_staleness", "samples_per_s"):
        values = [r[key] for r in by_seed.values()]
        out[f"{key}_mean"] = statistics.fmean(values)
        out[f"{key}_std"] = statistics.pstdev(values)
    out["samples_trained"] = next(iter(by_seed.values()))["samples_trained"]
    out["dropped"] = {k: sum(r["dropped"].get(k, 0) for r in by_seed.values())
                      for k in {k for r in by_seed.values() for k in r["dropped"]}}
    return out


# ---------------------------------------------------------------------------------------------- report


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """Per async setting, on the means over seeds: accuracy relative to sync's mean (and the worst seed's), the
    wall-time speed-up at equal samples, and stale drops as a share of the groups trained."""
    sync = results.get("sync")
    out: dict[str, Any] = {}
    if not sync:
        return out
    reference = sync["final_accuracy_mean"]
    for name, r in results.items():
        if not name.startswith("async_"):
            continue
        ratio = r["final_accuracy_mean"] / reference if reference else math.nan
        worst = min(x["final_accuracy"] for x in r["seeds"].values()) / reference if reference else math.nan
        groups = sum(x.get("groups_trained", 0) for x in r["seeds"].values())
        out[name] = {"accuracy_vs_sync": ratio, "worst_seed_vs_sync": worst,
                     "speedup_vs_sync": sync["wall_s_mean"] / r["wall_s_mean"],
                     "stale_drop_frac": r["dropped"].get("stale", 0) / groups if groups else math.nan,
                     "meets_target": bool(ratio >= 0.95 and r["wall_s_mean"] < sync["wall_s_mean"])}
    return out


def table(results: dict[str, Any], verdict: dict[str, Any]) -> str:
    lines = [f"{'setting':>22} {'accuracy (sd)':>14} {'vs sync':>8} {'worst':>6} {'last 3':>7} {'wall s (sd)':>12} "
             f"{'speed-up':>9} {'staleness':>10} {'dropped':>8}"]
    for s in SETTINGS:
        r = results.get(s.name)
        if r is None:
            continue
        v = verdict.get(s.name, {})
        dropped = sum(c for k, c in r["dropped"].items() if k != "unused_at_shutdown")
        lines.append(f"{s.name:>22} {r['final_accuracy_mean']:>7.1%} ({r['final_accuracy_std']:.1%}) "
                     f"{v.get('accuracy_vs_sync', 1.0):>8.2f} {v.get('worst_seed_vs_sync', 1.0):>6.2f} "
                     f"{r['last3_accuracy_mean']:>7.1%} {r['wall_s_mean']:>6.0f} ({r['wall_s_std']:>3.0f}) "
                     f"{v.get('speedup_vs_sync', 1.0):>8.2f}x {r['mean_staleness_mean']:>10.2f} {dropped:>8}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {0: "black", 1: "C0", 2: "C1", 4: "C2", 8: "C3"}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in SETTINGS:
        r = results.get(s.name)
        if r is None:
            continue
        for i, run in enumerate(r["seeds"].values()):  # one curve per seed, the setting's mean in the label
            xs = [p["wall_s"] for p in run["curve"]] + [run["wall_s"]]
            ys = [p["accuracy"] for p in run["curve"]] + [run["final_accuracy"]]
            style = {"truncate": "o-", "mask": "^-", "m2po": "d-"}[s.correction] if s.is_level != "none" else "s--"
            ax.plot(xs, ys, style, ms=3, color=colours[s.max_staleness],
                    label=None if i else f"{s.name} ({r['final_accuracy_mean']:.0%}, {r['wall_s_mean']:.0f}s)",
                    alpha=0.8 if s.is_level != "none" else 0.4)
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
    result = common.Result("learning", args, argv, module="bench.cpu.learning")
    bases, warm = {}, {}
    for seed in args.seeds:
        task = ex.arithmetic_task(n_held_out=args.held_out, seed=seed, reward=args.reward)
        base, warm[seed] = base_checkpoint(args, task, seed)
        bases[seed] = (task, base)
    results = asyncrl.run(run_all(args, bases))
    verdict = verdicts(results)
    budget = args.steps * args.batch_groups * args.n
    config = {"steps": args.steps, "n": args.n, "batch_groups": args.batch_groups, "lr": args.lr,
              "max_tokens": args.max_tokens, "held_out": args.held_out, "eval_every": args.eval_every,
              "sample_budget": budget, "pause_mode": "keep", "engine": "one VLLMEngine reused; base weights "
              "republished before each setting", "settings": [asdict(s) for s in SETTINGS]}
    suffix = "_quick" if args.quick else ""
    path = result.write({**results, "verdict": verdict}, suffix=suffix, quick=args.quick, config=config,
                        warm_start=warm)
    base_mean = statistics.fmean(results["base_accuracy"].values())
    plot(results, result.path(suffix, ".png"), f"GRPO on addition, {budget} samples per setting and seed, "
         f"{len(args.seeds)} seeds (base {base_mean:.0%} on average)")
    print(f"\nsame sample budget: {budget} samples ({args.steps} steps x {args.batch_groups} groups x {args.n}), "
          f"means over seeds {args.seeds}")
    print(table(results, verdict))
    hits = [k for k, v in verdict.items() if v["meets_target"] and not k.endswith("_no_is")]
    print(f"target (async with IS >= 95% of sync accuracy, less wall time): met by {hits or 'none'}")
    print(f"plot: {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
