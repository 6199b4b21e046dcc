"""The run that the demo's two trainers share, ``grpo_offpolicy.py`` (GRPO) and ``online_dpo.py`` (Online DPO,
XPO, Nash-MD): their command line, the model they start from (a tiny model built and warm-started, or
``--model``), the in-process engine's and the pipeline's configs, the policy, the training loop with held-out
evaluation, the saved model and the report. The two examples differ in the pipeline they build and nothing else.

A support module (see ``common.py``): it imports ``common``, ``sft`` and ``tracking``, and no example.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt
from asyncrl.examples import common, sft, tracking

LR, LORA_LR = 3e-4, 2e-3  # the learning rates of full fine-tuning and of a LoRA adapter


def build_parser(description: str) -> argparse.ArgumentParser:
    """The demo's options: data and model, the tiny model's warm start, GRPO, the loss (and LoRA), evaluation and
    output, checkpoints. ``online_dpo.py`` adds its trainer's options to them."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data = p.add_argument_group("data and model")
    data.add_argument("--prompts", type=Path, help="JSONL or Parquet file of problems: prompt/answer columns, "
                      "verl's parquet or GSM8K's question/answer (default: the built-in addition task)")
    data.add_argument("--prompt-key", help="prompts file: the prompt column, dotted for a nested field "
                      "(unset: prompt, else question)")
    data.add_argument("--answer-key", help="prompts file: the answer column, dotted for a nested field "
                      "(unset: answer, else reward_model.ground_truth, else extra_info.answer)")
    data.add_argument("--epochs", type=int, default=0,
                      help="passes over the training problems, each in a new seeded order; 0 = without end. "
                           "A finite run whose prompts run out before --steps stops with NoProgressError")
    data.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                      help="auto: chat messages through the tokenizer's chat template, text as it is; on: text too "
                           "(as one user message; needs --model with a template); off: never (messages joined)")
    data.add_argument("--model", type=Path, help="local HF model directory (skips building and warm start)")
    data.add_argument("--out", type=Path, default=Path("runs/grpo_offpolicy"), help="run directory")
    data.add_argument("--held-out", type=int, default=200, help="held-out problems for evaluation")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--reward", type=common.reward_spec, default="exact",
                      help="RL reward: exact (exact match; for a prompts file numbers compare as GSM8K's last "
                           "number), digits (addition task: partial credit per right digit), or "
                           "package.module:function, a function (prompt, sample) -> float as asyncrl's RewardFn "
                           "(accuracy is always exact match)")
    data.add_argument("--reversed-answers", action=argparse.BooleanOptionalAction, default=False,
                      help="addition task: write the sum ones digit first (the order a carry flows)")
    _tiny_model_args(p.add_argument_group("tiny model and warm start (without --model)"))
    _rl_args(p.add_argument_group("GRPO"))
    _loss_args(p.add_argument_group("loss"))
    misc = p.add_argument_group("evaluation and output")
    misc.add_argument("--eval-every", type=int, default=50, help="held-out eval every K steps (0 = off)")
    tracking.add_sink_args(misc, tensorboard="auto")
    misc.add_argument("--torch-threads", type=int, default=1,
                      help="torch threads for warm start and learner (more threads thrash on a busy 2-core machine)")
    misc.add_argument("--kv-cache-gib", type=float, default=1.0)
    misc.add_argument("--no-progress", action="store_true")
    misc.add_argument("--rollout-log", type=Path, metavar="DIR",
                      help="log every trained batch here (pyarrow), for `asyncrl replay DIR --checkpoint ...`")
    misc.add_argument("-v", "--verbose", action="store_true")
    tracking.add_checkpoint_args(p.add_argument_group("checkpoints"))
    return p


def _tiny_model_args(tiny: Any) -> None:
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (head size 32)")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--warm-target", type=float, default=0.3, help="stop SFT at this held-out accuracy")
    tiny.add_argument("--warm-max-steps", type=int, default=3000)
    tiny.add_argument("--warm-lr", type=float, default=1e-3)
    tiny.add_argument("--warm-window", type=int, default=1,
                      help="stop the warm start when the mean of this many evaluations reaches the target")
    tiny.add_argument("--warm-autocast", choices=("bfloat16",), default=None,
                      help="run the warm start under bf16 autocast (numerics as on another machine)")


def _rl_args(rl: Any) -> None:
    rl.add_argument("--steps", type=int, default=1000, help="learner steps")
    rl.add_argument("--n", type=int, default=8, help="completions per prompt (group size)")
    rl.add_argument("--batch-groups", type=int, default=16, help="groups per learner step")
    rl.add_argument("--max-tokens", type=int, default=6, help="completion length limit")
    rl.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    rl.add_argument("--lr", type=float, default=None, help=f"learning rate: {LR}, or {LORA_LR} with --lora (an "
                                                         "adapter moves the policy less per step)")
    rl.add_argument("--lr-warmup", type=int, default=25, help="learner steps over which lr ramps up linearly")
    rl.add_argument("--lr-decay", action=argparse.BooleanOptionalAction, default=True,
                    help="decay lr linearly to 0 at the last step")
    rl.add_argument("--max-staleness", type=int, default=2, help="versions a group may lag the learner")
    rl.add_argument("--queue-capacity", type=int, default=0,
                    help="0 = batch-groups x max(1, max-staleness - 1), see common.queue_capacity")
    rl.add_argument("--num-producers", type=int, default=1)
    rl.add_argument("--max-inflight", type=int, default=0, help="groups in flight per producer (0 = batch)")
    rl.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep")
    rl.add_argument("--clear-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="reset the KV/prefix cache at every weight sync")
    rl.add_argument("--sync-every", type=int, default=1, help="learner steps between weight publications")
    rl.add_argument("--synchronous", action="store_true", help="baseline: generate, then train (no overlap)")


def _loss_args(loss: Any) -> None:
    loss.add_argument("--estimator", choices=("grpo", "rloo"), default="grpo")
    loss.add_argument("--length-norm", choices=("token_mean", "seq_mean", "dr_grpo"), default="token_mean")
    loss.add_argument("--clip-low", type=float, default=0.2)
    loss.add_argument("--clip-high", type=float, default=0.28)
    loss.add_argument("--is-level", choices=("token", "sequence", "none"), default="token")
    loss.add_argument("--is-cap", type=float, default=2.0)
    loss.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds a frozen reference model")
    loss.add_argument("--entropy-coef", type=float, default=0.0)
    loss.add_argument("--lora", action="store_true",
                      help="train a LoRA adapter on the frozen policy and publish the adapter alone")
    loss.add_argument("--lora-rank", type=int, default=16)
    loss.add_argument("--lora-alpha", type=int, default=32)
    loss.add_argument("--probe-tolerance", type=float, default=None,
                      help="check every publication against the learner's log-probs (default with --lora: 1e-3)")


# ------------------------------------------------------------------------------------------ preparation


def prepare_model(args: argparse.Namespace, task: common.Task) -> tuple[Path, dict[str, Any]]:
    """The model RL starts from: ``--model`` as is, or a tiny model built and warm-started in ``out/base``."""
    if args.model is not None:
        return args.model, {}
    base = args.out / "base"
    if args.resume and (base / "config.json").is_file():  # the checkpoint holds the weights: no warm start again
        print(f"resuming: model config and tokenizer from {base}", flush=True)
        return base, {}
    shutil.rmtree(base, ignore_errors=True)
    sft.build_char_model(base, task, args.hidden, args.layers, args.seed)
    cfg = sft.WarmStart(target=args.warm_target, max_steps=args.warm_max_steps, lr=args.warm_lr,
                           autocast=args.warm_autocast, window=args.warm_window, seed=args.seed)
    result = sft.warm_start(base, task, cfg, progress=not args.no_progress)
    print(f"warm start: {result.steps} SFT steps in {result.seconds:.0f}s, held-out greedy accuracy "
          f"{result.accuracy:.1%} (transformers)", flush=True)
    return base, {"steps": result.steps, "accuracy": result.accuracy, "seconds": result.seconds}


def pipeline_config(args: argparse.Namespace, model_dir: Path | None = None) -> Any:
    """The ``PipelineConfig`` the flags ask for; the queue sized by ``common.queue_capacity`` unless given; the
    rollout log (``--rollout-log``) records ``model_dir`` for ``asyncrl replay``."""
    import asyncrl

    capacity = args.queue_capacity or common.queue_capacity(args.batch_groups, args.max_staleness)
    return asyncrl.PipelineConfig(
        progress=False,  # the example prints its own progress bar
        producer=asyncrl.ProducerConfig(
            sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature),
            max_inflight_groups=args.max_inflight or args.batch_groups,
        ),
        queue=asyncrl.QueueConfig(capacity=capacity, max_staleness=args.max_staleness),
        learner=asyncrl.LearnerConfig(
            batch_groups=args.batch_groups, lr=args.lr, micro_batch_rollouts=args.batch_groups * args.n,
            sync=asyncrl.SyncConfig(every=args.sync_every, mode=args.pause_mode, clear_cache=args.clear_cache,
                                    probe_tolerance=args.probe_tolerance or (1e-3 if args.lora else None)),
        ),
        num_producers=args.num_producers,
        rollout_log=None if args.rollout_log is None else asyncrl.RolloutLogConfig(
            args.rollout_log, model_dir=model_dir),
    )


def engine_config(args: argparse.Namespace, task: common.Task, tok: Any, model_dir: Path) -> Any:
    """The in-process engine serving ``model_dir``: a context that holds the task's longest prompt and a
    completion, room for every producer's groups, and an adapter slot with ``--lora``."""
    from asyncrl.engines.lora.transport import LoraServingConfig
    from asyncrl.engines.vllm_local import VLLMEngineConfig

    longest = max(len(encode_prompt(ex.prompt, tok)) for ex in task.train + task.held_out)
    max_len = 16 * -(-(longest + args.max_tokens + 1) // 16)
    seqs = max(64, args.n * args.batch_groups * args.num_producers)
    return VLLMEngineConfig(model=str(model_dir), dtype="float32", max_model_len=max(64, max_len),
                            max_num_seqs=seqs, kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                            lora=LoraServingConfig.holding(args.lora_rank) if args.lora else None)


def load_policy(model_dir: Path, frozen: bool = False, lora: Any = None) -> Any:
    """The policy from ``model_dir``; with ``lora`` (a ``LoraConfig``), wrapped to train an adapter alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if frozen:
        model.eval().requires_grad_(False)
    if lora is not None:
        from asyncrl.lora import apply_lora

        torch.manual_seed(0)  # the adapter's A matrices: the same start on every run of a seed
        model = apply_lora(model, lora)
    return model


def lora_config(args: argparse.Namespace) -> Any:
    """The adapter ``--lora`` asks for (``--lora-rank``, ``--lora-alpha``), or None for full fine-tuning."""
    from asyncrl.lora import LoraConfig

    return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora else None


# ------------------------------------------------------------------------------------------------- run


async def train(args: argparse.Namespace, engine: Any, tok: Any, task: common.Task, pipeline: Any,
                start: int) -> dict[str, Any]:
    """Accuracy before, ``pipeline`` trained up to step ``args.steps`` (with periodic evaluation, a progress bar
    and the learning-rate schedule the flags ask for), accuracy after. ``start``: the step the run starts from
    (``tracking.start_metrics``)."""
    evals = tracking.EvalHook(engine, tok, task, args.max_tokens, args.eval_every)
    before = await evals.evaluate(start)
    print(f"held-out greedy accuracy before RL{f' (resumed at step {start})' if start else ''}: {before:.1%}",
          flush=True)
    progress = tracking.ProgressHook(args.steps, disable=args.no_progress, initial=start)
    try:
        pipeline.learner.hooks += [evals, progress]
        if args.lr_warmup or args.lr_decay:
            pipeline.learner.hooks.append(tracking.lr_schedule(pipeline.learner.optimizer, args.lr_warmup,
                                                               args.steps if args.lr_decay else 0, start=start))
        stats = await (pipeline.run_synchronous if args.synchronous else pipeline.run)(args.steps)
    finally:
        progress.close()
    if pipeline.learner.step % args.sync_every:  # the last steps were not published yet
        await pipeline.learner.publish()
    after = await evals.evaluate(stats.steps)
    return {"before": before, "after": after, "eval_s": evals.seconds, "stats": _stats_dict(stats)}


def save_policy(model: Any, tok: Any, out: Path) -> None:
    """The trained policy as a plain transformers model; a LoRA run's adapter also on its own, beside it."""
    from asyncrl.lora import export_adapter, export_merged, is_lora

    shutil.rmtree(out, ignore_errors=True)
    if is_lora(model):
        export_merged(model, out, tok)
        shutil.rmtree(out.parent / "adapter", ignore_errors=True)
        export_adapter(model, out.parent / "adapter")
        return
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _stats_dict(stats: Any) -> dict[str, Any]:
    keys = ("steps", "version", "wall_s", "groups_trained", "samples_trained", "tokens_generated", "dropped",
            "unaccounted", "gen_s", "train_s", "sync_s")
    return {k: getattr(stats, k) for k in keys} | {"samples_per_s": stats.samples_per_s}


def report(args: argparse.Namespace, result: dict[str, Any], warm: dict[str, Any], total_s: float, *,
           name: str = "GRPO", plot_name: str = "grpo_offpolicy.png") -> None:
    """``summary.json``, the run plot (``plot_name``) and the closing lines on screen, from ``train``'s
    ``result``, the warm start's figures and the run's wall time; ``name`` is the trainer's."""
    rows = tracking.read_jsonl(args.out / "metrics.jsonl")
    tail = [r["train/reward_mean"] for r in rows[-10:] if "train/reward_mean" in r]
    final_reward = sum(tail) / len(tail) if tail else float("nan")
    stale = rows[-1].get("rollout/staleness_mean", 0.0) if rows else 0.0
    stats = result["stats"]
    summary = {**result, "warm_start": warm, "final_reward_last10": final_reward, "staleness_mean": stale,
               "total_s": total_s, "args": common.jsonable(vars(args))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    rows_for_plot = rows + [{"step": stats["steps"], "eval/accuracy": result["after"]}]
    plot = tracking.plot_run(rows_for_plot, args.out / plot_name, before=result["before"],
                             title=f"{name}, max staleness {args.max_staleness}, is_level {args.is_level}",
                             start=result["start_step"])
    print(f"{name}: {stats['steps']} steps, {stats['samples_trained']} samples in {stats['wall_s']:.0f}s "
          f"({stats['samples_per_s']:.0f} samples/s; train {stats['train_s']:.0f}s, sync {stats['sync_s']:.0f}s, "
          f"eval {result['eval_s']:.0f}s); dropped {stats['dropped']}; mean staleness {stale:.2f}")
    print(f"final reward (mean of last 10 steps): {final_reward:.3f}")
    print(f"run dir: {args.out}  (metrics.jsonl, {plot.name}, summary.json, model/)")
    print(f"total wall time: {total_s:.0f}s")
    print(f"held-out accuracy: before {result['before']:.1%} -> after {result['after']:.1%}")
