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
The run around the trainer (these flags, the model, the engine, the training loop, the report) is ``demo.py``'s,
shared with ``online_dpo.py``; this program builds the GRPO pipeline.

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
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt
from asyncrl.groups import RewardGroups
from asyncrl.examples import common, demo, tracking


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = demo.build_parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    args.lr = args.lr or (demo.LORA_LR if args.lora else demo.LR)
    tracking.check_args(p, args)  # a missing sink package or checkpoint: refused now, not after the warm start
    return args


def loss_config(args: argparse.Namespace) -> Any:
    from asyncrl.algorithms.losses import LossConfig

    # The scoring temperature and dr_grpo's token budget come from the sampling config (grpo_pipeline).
    return LossConfig(estimator=args.estimator, length_norm=args.length_norm, clip_low=args.clip_low,
                      clip_high=args.clip_high, is_level=args.is_level, is_cap=args.is_cap, kl_coef=args.kl_coef,
                      entropy_coef=args.entropy_coef)


def reference(args: argparse.Namespace, model_dir: Path) -> Any:
    """The KL penalty's frozen reference: the base itself under LoRA (no second copy), else a frozen copy."""
    if args.kl_coef <= 0:
        return None
    if args.lora:
        from asyncrl.lora import LoraReference

        return LoraReference()
    return demo.load_policy(model_dir, frozen=True)


# ------------------------------------------------------------------------------------------------- run


async def build_pipeline(args: argparse.Namespace, config: Any, engine: Any, task: common.Task, tok: Any,
                         model_dir: Path, monitor: Any, checkpoint: Any = None, checkpointer: Any = None) -> Any:
    """GRPO on ``engine`` through ``asyncrl.recipes.grpo_pipeline``, or continued from ``checkpoint``
    (``tracking.build_pipeline``); the engine outlives the pipeline."""
    return await tracking.build_pipeline(
        engine, demo.load_policy(model_dir, lora=demo.lora_config(args)), common.rl_prompts(task, tok, args.seed),
        RewardGroups(common.prompt_reward(task)), config, checkpoint=checkpoint, checkpointer=checkpointer,
        loss_config=loss_config(args), pad_id=common.pad_id(tok), ref_model=reference(args, model_dir), monitor=monitor,
        close_engine=False,  # closed in main(), after the final evaluation
    )


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    """Engine up -> (resume) -> accuracy before -> GRPO up to step ``args.steps`` -> accuracy after -> save.
    Always shuts down."""
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    checkpoint = tracking.resume_point(args)
    start = tracking.start_metrics(args.out, checkpoint)
    monitor = tracking.open_monitor(args, common.jsonable(vars(args)))
    common.announce_engine_start()
    t_engine = time.perf_counter()
    engine = await VLLMEngine.start(demo.engine_config(args, task, tok, model_dir))
    try:
        async with tracking.open_checkpointer(args) as checkpointer:
            config = demo.pipeline_config(args, model_dir)
            await common.warm_up(engine, encode_prompt(task.train[0].prompt, tok), config.producer.sampling,
                                 args.batch_groups)
            engine_s = time.perf_counter() - t_engine
            print(f"engine up in {engine_s:.0f}s", flush=True)
            pipeline = await build_pipeline(args, config, engine, task, tok, model_dir, monitor, checkpoint,
                                            checkpointer)
            result = await demo.train(args, engine, tok, task, pipeline, start)
    finally:
        monitor.close()
        await engine.close()
    demo.save_policy(pipeline.learner.model, tok, args.out / "model")
    return {**result, "engine_start_s": engine_s, "start_step": start}


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.start_cli(args.verbose, args.torch_threads)
    import asyncrl

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    task = common.task_from_args(args)
    print(f"task {task.name}: {len(task.train)} training / {len(task.held_out)} held-out problems", flush=True)
    model_dir, warm = demo.prepare_model(args, task)
    result = asyncrl.run(main(args, task, model_dir))
    demo.report(args, result, warm, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_cli(cli))  # Ctrl-C exits 130, SIGTERM 143, as the asyncrl-* commands do
