"""Asynchronous off-policy GRPO that learns, on a 2-core CPU, in a few minutes.

    python -m asyncrl.examples.grpo_offpolicy                      # tiny model + addition task (make demo)
    python -m asyncrl.examples.grpo_offpolicy --steps 20 --out runs/quick
    python -m asyncrl.examples.grpo_offpolicy --prompts gsm8k.parquet --model path/to/hf-model --max-tokens 256

Without ``--model`` a character-level Qwen2 model is built locally and warm-started with supervised
teacher forcing (prompt -> answer + EOS) until its held-out greedy accuracy reaches ``--warm-target``; then
it is trained with GRPO: vLLM producers sample groups into a bounded queue while the learner trains on
them, with groups up to ``--max-staleness`` versions old corrected by truncated importance weights. The
learning rate ramps up over ``--lr-warmup`` steps and decays linearly to 0 at the last step: a tiny policy's
greedy answers flip from step to step at a constant rate, and the decay lets the last ones settle
(``bench/cpu/demo_seeds.py`` measures the recipe over seeds).

Rewards: the addition task scores exact matches. A ``--prompts`` file (read by ``asyncrl.data.load_examples``:
``prompt`` / ``answer`` columns, verl's GSM8K parquet, Hugging Face GSM8K, or ``--prompt-key`` / ``--answer-key``)
is scored by ``asyncrl.data.answer_reward``: 1 when the stripped completion equals the answer, or, for numeric
answers (GSM8K ``#### N``), when the last number in the completion equals it. ``--reward package.module:function``
trains on your own reward instead.

Writes into ``--out``: ``metrics.jsonl`` (one row per learner step), ``grpo_offpolicy.png``,
``summary.json``, ``base/`` (the warm-started model) and ``model/`` (the trained model and tokenizer,
loadable by transformers and vLLM). Ctrl-C stops cleanly: the run is cancelled and the engine shut down.

Sinks: ``metrics.jsonl`` always; TensorBoard with ``--tensorboard on`` (``auto``: if installed) and Weights & Biases
with ``--wandb PROJECT`` (``--wandb-run-name``). One asked for and not installed is refused at once, naming the
extra to install (``pip install 'asyncrl[tensorboard]'``, ``'asyncrl[wandb]'``).

Checkpoints: ``--checkpoint-dir DIR --checkpoint-every K`` writes ``DIR/step-NNNNNN`` every K learner steps (the
newest 3 kept); ``--resume latest`` (or a checkpoint directory) continues up to ``--steps`` in total. The step
count, the prompt order (the cursor), the weights, the optimiser, the RNG states, the learning-rate schedule and
the group books continue; groups that were queued or being generated when the checkpoint was taken are not
replayed (they count as dropped, ``unused_at_shutdown``). ``metrics.jsonl`` keeps its rows up to the checkpoint's
step. Without ``--model``, a resume in the same ``--out`` reuses ``base/`` (no warm start again).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt
from asyncrl.groups import RewardGroups
from asyncrl.examples import common, sft, tracking

log = logging.getLogger("asyncrl.examples.grpo_offpolicy")


LR, LORA_LR = 3e-4, 2e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    args.lr = args.lr or (LORA_LR if args.lora else LR)
    tracking.check_args(p, args)  # a missing sink package or checkpoint: refused now, not after the warm start
    return args


def build_parser(description: str) -> argparse.ArgumentParser:
    """The example's options (the preference example adds its own to them)."""
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


def load_task(args: argparse.Namespace) -> common.Task:
    return common.task_from_args(args)


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
        rollout_log=None if args.rollout_log is None else asyncrl.RolloutLogConfig(args.rollout_log,
                                                                                   model_dir=model_dir),
    )


def loss_config(args: argparse.Namespace) -> Any:
    from asyncrl.algorithms.losses import LossConfig

    # The scoring temperature and dr_grpo's token budget come from the sampling config (grpo_pipeline).
    return LossConfig(estimator=args.estimator, length_norm=args.length_norm, clip_low=args.clip_low,
                      clip_high=args.clip_high, is_level=args.is_level, is_cap=args.is_cap, kl_coef=args.kl_coef,
                      entropy_coef=args.entropy_coef)


def engine_config(args: argparse.Namespace, task: common.Task, tok: Any, model_dir: Path) -> Any:
    from asyncrl.engines.transports.adapters import LoraServingConfig
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
    from asyncrl.lora import LoraConfig

    return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora else None


def reference(args: argparse.Namespace, model_dir: Path) -> Any:
    """The KL penalty's frozen reference: the base itself under LoRA (no second copy), else a frozen copy."""
    if args.kl_coef <= 0:
        return None
    if args.lora:
        from asyncrl.lora import LoraReference

        return LoraReference()
    return load_policy(model_dir, frozen=True)


# ------------------------------------------------------------------------------------------------- run


async def build_pipeline(args: argparse.Namespace, config: Any, engine: Any, task: common.Task, tok: Any,
                         model_dir: Path, monitor: Any, checkpoint: Any = None, checkpointer: Any = None) -> Any:
    """GRPO on ``engine`` through ``asyncrl.recipes.grpo_pipeline``, or continued from ``checkpoint``
    (``tracking.build_pipeline``); the engine outlives the pipeline."""
    return await tracking.build_pipeline(
        engine, load_policy(model_dir, lora=lora_config(args)), common.rl_prompts(task, tok, args.seed),
        RewardGroups(common.prompt_reward(task)), config, checkpoint=checkpoint, checkpointer=checkpointer,
        loss_config=loss_config(args), pad_id=_pad_id(tok), ref_model=reference(args, model_dir), monitor=monitor,
        close_engine=False,  # closed in main(), after the final evaluation
    )


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    """Engine up -> (resume) -> accuracy before -> GRPO up to step ``args.steps`` -> accuracy after -> save.
    Always shuts down."""
    from transformers import AutoTokenizer

    common.cancel_on_sigterm()

    from asyncrl.engines.vllm_local import VLLMEngine

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    checkpoint = tracking.resume_point(args)
    start = tracking.start_metrics(args.out, checkpoint)
    monitor = tracking.open_monitor(args, _jsonable(vars(args)))
    common.announce_engine_start()
    t_engine = time.perf_counter()
    engine = await VLLMEngine.start(engine_config(args, task, tok, model_dir))
    try:
        async with tracking.open_checkpointer(args) as checkpointer:
            config = pipeline_config(args, model_dir)
            await common.warm_up(engine, encode_prompt(task.train[0].prompt, tok), config.producer.sampling,
                                 args.batch_groups)
            engine_s = time.perf_counter() - t_engine
            print(f"engine up in {engine_s:.0f}s", flush=True)
            pipeline = await build_pipeline(args, config, engine, task, tok, model_dir, monitor, checkpoint,
                                            checkpointer)
            result = await _train(args, engine, tok, task, pipeline, start)
    finally:
        monitor.close()
        await engine.close()
    _save(pipeline.learner.model, tok, args.out / "model")
    return {**result, "engine_start_s": engine_s, "start_step": start}


async def _train(args: argparse.Namespace, engine: Any, tok: Any, task: common.Task, pipeline: Any,
                 start: int) -> dict[str, Any]:
    """Accuracy before, GRPO up to step ``args.steps`` (with periodic evaluation), accuracy after."""
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


def _pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _save(model: Any, tok: Any, out: Path) -> None:
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


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def report(args: argparse.Namespace, result: dict[str, Any], warm: dict[str, Any], total_s: float, *,
           name: str = "GRPO", plot_name: str = "grpo_offpolicy.png") -> None:
    rows = tracking.read_jsonl(args.out / "metrics.jsonl")
    tail = [r["train/reward_mean"] for r in rows[-10:] if "train/reward_mean" in r]
    final_reward = sum(tail) / len(tail) if tail else float("nan")
    stale = rows[-1].get("rollout/staleness_mean", 0.0) if rows else 0.0
    stats = result["stats"]
    summary = {**result, "warm_start": warm, "final_reward_last10": final_reward, "staleness_mean": stale,
               "total_s": total_s, "args": _jsonable(vars(args))}
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


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.start_cli(args.verbose, args.torch_threads)
    import asyncrl

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    task = load_task(args)
    print(f"task {task.name}: {len(task.train)} training / {len(task.held_out)} held-out problems", flush=True)
    model_dir, warm = prepare_model(args, task)
    result = asyncrl.run(main(args, task, model_dir))
    report(args, result, warm, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    from asyncrl.examples.entry import run_cli

    sys.exit(run_cli(cli))  # Ctrl-C exits 130, SIGTERM 143, as the asyncrl-* commands do
