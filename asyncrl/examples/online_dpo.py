"""Online preference optimisation (Online DPO, XPO, Nash-MD) on the demo's task, with a pairwise judge.

    python -m asyncrl.examples.online_dpo                         # Online DPO on the tiny model + addition task
    python -m asyncrl.examples.online_dpo --trainer xpo           # XPO: a second engine serves the reference
    python -m asyncrl.examples.online_dpo --trainer nash_md       # Nash-MD: the mixture sampled in torch, here
    python -m asyncrl.examples.online_dpo --loss-type ipo --beta 0.5 --synchronous

Everything but the trainer is the GRPO demo's (``asyncrl.examples.grpo_offpolicy``; the two share ``demo.py``,
and its options all apply): the same locally built model and warm start, the same in-process vLLM engine, queue,
staleness bound and held-out evaluation. The judge is derived from the task's exact answer
(``judge_from_reward``): of two completions the right one wins, and two right or two wrong ones tie. Groups whose
comparisons all tie are dropped and counted (``preference_tie``), as are groups whose judge raises or times out.

- ``dpo``: each group's best completion against its worst (``--n`` completions, judged round robin).
- ``xpo``: each completion against one the frozen reference samples, served by a second vLLM engine started
  from the warm-started weights and never published to (with ``--lora``: by the same engine, requests without
  the adapter); the loss adds ``--alpha`` times the policy's log-prob of the reference's completion.
- ``nash_md``: each completion against one sampled from the geometric mixture of policy and reference
  (``--mixture-coef``), token by token in torch on this machine's CPU; the cost shows as ``judge/opponent_s``.

The reference the losses score is a frozen copy of the warm-started policy (``--lora``: the base under the
adapter, no copy). Writes ``metrics.jsonl`` (``pref/*``: margins, chosen/rejected rewards, KL to the
reference; ``judge/*``: comparisons, ties, win rate against the opponent), a plot and ``summary.json`` into
``--out``. Checkpoints are written as for GRPO; ``--resume`` is not offered for these trainers yet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt
from asyncrl.examples import common, demo, tracking

DPO_LR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = demo.build_parser(__doc__.split("\n\n")[0])
    p.set_defaults(out=Path("runs/online_dpo"))
    pref = p.add_argument_group("preference")
    pref.add_argument("--trainer", choices=("dpo", "xpo", "nash_md"), default="dpo")
    pref.add_argument("--beta", type=float, default=0.1, help="DPO/IPO beta; Nash-MD's KL weight")
    pref.add_argument("--loss-type", choices=("sigmoid", "ipo"), default="sigmoid")
    pref.add_argument("--alpha", type=float, default=1e-5, help="XPO's exploration weight")
    pref.add_argument("--mixture-coef", type=float, default=0.5, help="Nash-MD: the reference's share of the logits")
    pref.add_argument("--pairs", choices=("best_worst", "all"), default="best_worst",
                      help="Online DPO's pairs in a group: its best against its worst, or every two judged apart")
    pref.add_argument("--pair-is", action="store_true",
                      help="weight pairs by their truncated sequence importance weight (proximal/behaviour)")
    args = p.parse_args(argv)
    if args.resume:
        p.error("--resume: not offered for the preference trainers yet (checkpoints are written)")
    args.lr = args.lr or (demo.LORA_LR if args.lora else DPO_LR)
    tracking.check_args(p, args)
    return args


def judge_of(task: common.Task) -> Any:
    from asyncrl.preference import judge_from_reward

    return judge_from_reward(common.prompt_reward(task))


def reference_model(args: argparse.Namespace, model_dir: Path) -> Any:
    if args.lora:
        from asyncrl.lora import LoraReference

        return LoraReference()
    return demo.load_policy(model_dir, frozen=True)


async def start_opponent(args: argparse.Namespace, task: common.Task, tok: Any, model_dir: Path, engine: Any,
                         policy: Any, ref: Any) -> Any:
    """XPO: the base, served by the LoRA engine itself under --lora, else by a second engine on the base weights;
    Nash-MD: the mixture sampler; DPO: none."""
    if args.trainer == "xpo" and args.lora:
        return engine.base_sampler()
    if args.trainer == "xpo":
        import dataclasses

        from asyncrl.engines.vllm_local import VLLMEngine

        cfg = dataclasses.replace(demo.engine_config(args, task, tok, model_dir), lora=None)
        return await VLLMEngine.start(cfg, name="reference")
    if args.trainer == "nash_md":
        from asyncrl.preference import MixtureSampler

        base = ref if not args.lora else demo.load_policy(model_dir, frozen=True)
        longest = max(len(encode_prompt(ex.prompt, tok)) for ex in task.train + task.held_out)
        return MixtureSampler(policy, base, tok, mixture_coef=args.mixture_coef, seed=args.seed,
                              max_model_len=longest + args.max_tokens + 1)
    return None


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.checkpoint import checkpoint_hook
    from asyncrl.engines.vllm_local import VLLMEngine
    from asyncrl.preference import PreferenceConfig, preference_pipeline

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    start = tracking.start_metrics(args.out, None)
    monitor = tracking.open_monitor(args, common.jsonable(vars(args)))
    common.announce_engine_start()
    t_engine = time.perf_counter()
    engine = await VLLMEngine.start(demo.engine_config(args, task, tok, model_dir))
    opponent = None
    try:
        async with tracking.open_checkpointer(args) as checkpointer:
            config = demo.pipeline_config(args)
            await common.warm_up(engine, encode_prompt(task.train[0].prompt, tok), config.producer.sampling,
                                 args.batch_groups)
            policy = demo.load_policy(model_dir, lora=demo.lora_config(args))
            ref = reference_model(args, model_dir)
            opponent = await start_opponent(args, task, tok, model_dir, engine, policy, ref)
            engine_s = time.perf_counter() - t_engine
            two = args.trainer == "xpo" and not args.lora
            print(f"engine{'s' if two else ''} up in {engine_s:.0f}s", flush=True)
            source = common.rl_prompts(task, tok, args.seed)
            preference = PreferenceConfig(beta=args.beta, loss_type=args.loss_type, alpha=args.alpha,
                                          is_correction=args.pair_is, pairs=args.pairs)
            pipeline = preference_pipeline(engine, policy, source, judge_of(task), config, trainer=args.trainer,
                                           preference=preference, ref_model=ref, opponent=opponent,
                                           pad_id=common.pad_id(tok), monitor=monitor, close_engine=False)
            if checkpointer is not None:
                pipeline.learner.hooks.append(checkpoint_hook(checkpointer, pipeline.learner, source))
            result = await demo.train(args, engine, tok, task, pipeline, start)
    finally:
        monitor.close()
        await _close(opponent)
        await engine.close()
    demo.save_policy(pipeline.learner.model, tok, args.out / "model")
    return {**result, "engine_start_s": engine_s, "start_step": start}


async def _close(opponent: Any) -> None:
    from asyncrl.engines.vllm_local import VLLMEngine
    from asyncrl.preference import MixtureSampler

    if isinstance(opponent, VLLMEngine):  # XPO's second engine (a base sampler closes with its engine)
        await opponent.close()
    elif isinstance(opponent, MixtureSampler):
        opponent.close()


NAMES = {"dpo": "Online DPO", "xpo": "XPO", "nash_md": "Nash-MD"}


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
    demo.report(args, result, warm, time.perf_counter() - t0, name=NAMES[args.trainer],
                          plot_name="online_dpo.png")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_cli(cli))
