"""Tool use with multi-turn GRPO: a tiny model learns to call a calculator for products it cannot compute.

    python -m asyncrl.examples.tool_use                    # build, warm-start, RL (a few minutes on a 2-core CPU)
    python -m asyncrl.examples.tool_use --steps 20 --out runs/tool_quick

The task is ``a*b=`` with two-digit operands, far beyond what a 2-layer character-level model learns to
multiply in minutes. The model may instead write ``<calc>a*b</calc>``: its turn ends at the ``</calc>`` token,
the environment runs the calculator (a plain async function, with a timeout) and appends ``<res>product</res>``
as environment tokens; the model's next turn is its answer. A turn without a call is the final answer, and the
environment rewards an exact one with 1.0. Tool markers are single tokens, as ``<tool_call>`` is in chat models.

The supervised warm start teaches the format on a mix: ``--warm-tool-frac`` of its examples use the tool, the
rest answer directly (and mostly wrongly: the model cannot multiply). So RL starts from a policy that calls the
tool sometimes; GRPO on whole episodes (the loss masks out environment tokens) raises the tool-call rate and
with it the held-out accuracy. Accuracy is measured greedily through the same episode runner.

The task, the calculator and the call format live in ``asyncrl/examples/calculator.py``.

Writes into ``--out``: ``metrics.jsonl`` (one row per learner step, ``episode/*`` gauges included),
``tool_use.png``, ``summary.json`` and ``base/`` (the warm-started model). ``--tensorboard`` and ``--wandb PROJECT``
add sinks; ``--checkpoint-dir DIR --checkpoint-every K`` checkpoints and ``--resume latest`` continues a run, as in
``grpo_offpolicy.py`` (``tracking.py`` holds both).
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
from asyncrl.examples import common, sft, tracking
from asyncrl.examples.calculator import END_CALL, TOOL_TOKENS, CalculatorProtocol, multiplication_task

log = logging.getLogger("asyncrl.examples.tool_use")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/tool_use"), help="run directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out", type=int, default=200, help="held-out problems for evaluation")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=800, help="supervised warm-start steps (batch 64)")
    p.add_argument("--warm-tool-frac", type=float, default=0.25, help="share of warm-start examples using the tool")
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=100, help="learner steps")
    p.add_argument("--n", type=int, default=8, help="episodes per prompt (group size)")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per learner step")
    p.add_argument("--turn-tokens", type=int, default=10, help="model tokens per turn at most")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep")
    p.add_argument("--eval-every", type=int, default=20, help="held-out eval every K steps (0 = off)")
    tracking.add_sink_args(p, tensorboard="off")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    tracking.add_checkpoint_args(p.add_argument_group("checkpoints"))
    args = p.parse_args(argv)
    tracking.check_args(p, args)  # a missing sink package or checkpoint: refused now, not after the warm start
    return args


# ------------------------------------------------------------------------------------------ evaluation


def _prompt(tok: Any, ex: common.Example, prompt_id: str) -> Any:
    from asyncrl import Prompt

    return Prompt(prompt_id, encode_prompt(ex.prompt, tok), str(ex.prompt), ex.answer)


class EvalHook:
    """Greedy held-out accuracy and tool-call rate: every ``every`` learner steps as ``eval/accuracy`` and
    ``eval/tool_rate`` (with the rest of the library ``Evaluator``'s ``eval/*``), and on demand (``evaluate``).
    The ``Evaluator`` plays each held-out prompt as one greedy episode through the same episode runner as
    training; the tool-call rate is the share of those episodes that called the calculator."""

    def __init__(self, engine: Any, tok: Any, task: common.Task, producer_config: Any, every: int) -> None:
        from asyncrl import EpisodeGroups, Evaluator

        prompts = [_prompt(tok, ex, f"held-out-{i}") for i, ex in enumerate(task.held_out)]
        episodes = EpisodeGroups(CalculatorProtocol(tok).env_factory(task.reward))
        self.evaluator = Evaluator(engine, prompts, episodes, every=every, config=producer_config)

    @property
    def seconds(self) -> float:
        return self.evaluator.seconds

    async def evaluate(self) -> dict[str, float]:
        metrics = await self.evaluator.evaluate()
        return {"accuracy": metrics["eval/accuracy"], "tool_rate": metrics["eval/episode/tool_call_rate"]}

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        await self.evaluator(step, metrics)
        if "eval/accuracy" in metrics:  # evaluated at this step
            metrics["eval/tool_rate"] = metrics["eval/episode/tool_call_rate"]


# ------------------------------------------------------------------------------------------------- run


def producer_config(args: argparse.Namespace, tok: Any) -> Any:
    import asyncrl

    end_call = tok.convert_tokens_to_ids(END_CALL)
    return asyncrl.ProducerConfig(
        sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.turn_tokens, temperature=args.temperature,
                                        stop_token_ids=(end_call,)),
        max_inflight_groups=args.batch_groups,
        episode=asyncrl.EpisodeConfig(max_turns=args.max_turns, max_episode_tokens=args.max_turns * 16,
                                      max_env_tokens=12, env_timeout_s=10.0),
    )


def pipeline_config(args: argparse.Namespace, tok: Any) -> Any:
    import asyncrl

    return asyncrl.PipelineConfig(
        progress=False,  # the example prints its own progress bar
        producer=producer_config(args, tok),
        queue=asyncrl.QueueConfig(capacity=common.queue_capacity(args.batch_groups, args.max_staleness),
                                  max_staleness=args.max_staleness),
        learner=asyncrl.LearnerConfig(batch_groups=args.batch_groups, lr=args.lr,
                                      micro_batch_rollouts=args.batch_groups * args.n,
                                      sync=asyncrl.SyncConfig(mode=args.pause_mode)),
    )


def prepare_model(args: argparse.Namespace, task: common.Task) -> tuple[Path, dict[str, Any]]:
    """A tiny character-level model with the tool tokens, warm-started in ``out/base``."""
    base = args.out / "base"
    if args.resume and (base / "config.json").is_file():  # the checkpoint holds the weights: no warm start again
        print(f"resuming: model config and tokenizer from {base}", flush=True)
        return base, {}
    shutil.rmtree(base, ignore_errors=True)
    sft.build_char_model(base, task, args.hidden, args.layers, args.seed, added_tokens=TOOL_TOKENS)
    info = sft.tool_warm_start(base, task, args.warm_steps, args.warm_tool_frac, args.warm_lr, args.seed,
                      progress=not args.no_progress)
    print(f"warm start: {info['steps']} SFT steps in {info['seconds']:.0f}s (loss {info['final_loss']:.3f})",
          flush=True)
    return base, info


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    """Engine up -> (resume) -> evaluation before -> GRPO on episodes up to step ``args.steps`` -> evaluation
    after. Always shuts the engine down."""
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    checkpoint = tracking.resume_point(args)
    start = tracking.start_metrics(args.out, checkpoint)
    monitor = tracking.open_monitor(args, common.jsonable(vars(args)))
    config = pipeline_config(args, tok)
    engine = await VLLMEngine.start(VLLMEngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=16 * (args.max_turns + 2), seed=args.seed,
        max_num_seqs=max(64, args.n * args.batch_groups), kv_cache_gib=args.kv_cache_gib))
    try:
        async with tracking.open_checkpointer(args) as checkpointer:
            pipeline = await _build_pipeline(args, engine, tok, task, model_dir, config, monitor, checkpoint,
                                             checkpointer)
            result = await _train(args, engine, tok, task, config, pipeline, start)
    finally:
        monitor.close()
        await engine.close()
    return {**result, "start_step": start}


async def _build_pipeline(args: argparse.Namespace, engine: Any, tok: Any, task: common.Task, model_dir: Path,
                          config: Any, monitor: Any, checkpoint: Any, checkpointer: Any) -> Any:
    from asyncrl import EpisodeGroups, PromptSource
    from asyncrl.algorithms.losses import LossConfig

    prompts = PromptSource(_prompt(tok, ex, f"train-{i}") for i, ex in common.endless(task.train, args.seed))
    episodes = EpisodeGroups(CalculatorProtocol(tok).env_factory(task.reward))
    return await tracking.build_pipeline(engine, _load_policy(model_dir), prompts, episodes, config,
                                         checkpoint=checkpoint, checkpointer=checkpointer, loss_config=LossConfig(),
                                         pad_id=tok.pad_token_id, monitor=monitor, close_engine=False)


async def _train(args: argparse.Namespace, engine: Any, tok: Any, task: common.Task, config: Any, pipeline: Any,
                 start: int) -> dict[str, Any]:
    evals = EvalHook(engine, tok, task, config.producer, args.eval_every)
    before = await evals.evaluate()
    print(f"before RL{f' (resumed at step {start})' if start else ''}: held-out greedy accuracy "
          f"{before['accuracy']:.1%}, tool-call rate {before['tool_rate']:.1%}", flush=True)
    progress = tracking.ProgressHook(args.steps, desc="GRPO (tool use)", disable=args.no_progress, initial=start)
    try:
        pipeline.learner.hooks += [evals, progress]
        stats = await pipeline.run(args.steps)
    finally:
        progress.close()
    after = await evals.evaluate()
    return {"before": before, "after": after, "eval_s": evals.seconds, "steps": stats.steps,
            "wall_s": stats.wall_s, "samples_trained": stats.samples_trained, "dropped": stats.dropped}


def _load_policy(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ report


def report(args: argparse.Namespace, result: dict[str, Any], warm: dict[str, Any], total_s: float) -> None:
    rows = tracking.read_jsonl(args.out / "metrics.jsonl")
    summary = {**result, "warm_start": warm, "total_s": total_s, "args": common.jsonable(vars(args))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    png = tracking.plot_tool_run(rows, args.out / "tool_use.png", result["before"], result["after"],
                                 result["steps"], result["start_step"])
    tracking.print_tool_result(args.out, result, png, total_s)


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.start_cli(args.verbose, args.torch_threads)
    import asyncrl

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    task = multiplication_task(n_held_out=args.held_out, seed=args.seed)
    model_dir, warm = prepare_model(args, task)
    result = asyncrl.run(main(args, task, model_dir))
    report(args, result, warm, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_cli(cli))  # Ctrl-C exits 130, SIGTERM 143, as the asyncrl-* commands do
