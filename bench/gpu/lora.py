"""LoRA against full fine-tuning on one GPU, side by side in one process: the same warm-started shape, task,
batches and pipeline (ours, async, ``bench.gpu.workload``'s settings), trained once with every weight and once
through a LoRA adapter published alone.

    python -m bench.gpu.lora --shapes qwen2-0.5b --steps 12 --tag q05      # one shape per command (the H200
    python -m bench.gpu.lora --cpu-smoke                                   # figures: bench/gpu/run_lora.sh)

Per shape and side: the publication pause (mean and largest, seconds the engine was paused per publication),
the learner's peak GPU memory (what this process's torch allocated: weights, gradients, optimiser state,
activations; the engine lives in its own processes), trainable parameters, trained samples/s and completion
tokens/s (steady state), generated tokens/s, the whole GPU's peak use (the engine's memory included), and the
reward. Each side starts its own engine: full weights for ``full``, LoRA serving for ``lora``. Writes
``bench/results/lora_<device>[_TAG].json``; on the H200 one shape per command fits a command's time limit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu import workload
from bench.gpu.memory import free_gpu, watch
from bench.gpu.workload_rates import describe
from bench.gpu.workload_task import prepare_model, task_prompts

SIDES = ("full", "lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--lora-rank", type=int, default=32)
    extra.add_argument("--lora-alpha", type=int, default=64)
    extra.add_argument("--lora-lr", type=float, default=2e-5, help="the adapter's learning rate (full: --lr)")
    extra.add_argument("--lora-sides", default=",".join(SIDES), help="comma-separated subset of full,lora")
    ours, rest = extra.parse_known_args(argv)
    args = workload.parse_args(rest)
    args.sides = ["async"]  # ours, async only: no sleeping engine, no TRL
    for key, value in vars(ours).items():
        setattr(args, key, value)
    args.lora_sides = args.lora_sides.split(",")
    return args


async def side(args: argparse.Namespace, model_dir: Path, name: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine
    from asyncrl.lora import LoraConfig

    lora = LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha) if name == "lora" else None
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = task_prompts(args, tok, args.steps * args.batch_groups * 3)
    t0 = time.perf_counter()
    engine = await VLLMEngine.start(workload.engine_config(args, model_dir, lora))
    start_s = time.perf_counter() - t0
    print(f"[{name}] engine up in {start_s:.0f}s", flush=True)  # a run cut short still says where time went
    try:
        out = await workload.one_run(args, engine, model_dir, tok, prompts, False, watch(args), lora=lora,
                                     lr=args.lora_lr if lora else args.lr)
    finally:
        await engine.close()
        free_gpu()
    return {"engine_start_s": start_s, "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha},
            **out}


def compare(full: dict[str, Any], lora: dict[str, Any]) -> dict[str, float]:
    """LoRA over full, per figure (a pause or memory ratio below 1 is LoRA's gain)."""
    def ratio(key: str, sub: str | None = None) -> float:
        a, b = (lora[key], full[key]) if sub is None else (lora[key][sub], full[key][sub])
        return a / b if b else float("nan")

    return {"publication_pause_mean": ratio("publication_pause_s", "mean"),
            "learner_peak_allocated": ratio("learner_peak_allocated_gib"),
            "trainable_params": ratio("trainable_params"),
            "samples_per_s": ratio("samples_per_s"), "tokens_per_s": ratio("completion_tokens_per_s"),
            "samples_per_s_steady": ratio("samples_per_s_steady"),
            "tokens_per_s_steady": ratio("completion_tokens_per_s_steady")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    import asyncrl

    result = common.Result("lora", args, argv, module="bench.gpu.lora")
    suffix = f"_{args.tag}" if args.tag else ""
    shapes: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        entry: dict[str, Any] = {}
        shapes[shape] = entry
        model_dir, entry["warm_start"] = prepare_model(args, shape)
        for name in args.lora_sides:
            entry[name] = asyncrl.run(side(args, model_dir, name))
            print(f"[{shape}] {name}: {describe(entry[name])}", flush=True)
            result.write({"shapes": shapes}, suffix=suffix)
        if "full" in entry and "lora" in entry:
            entry["lora_over_full"] = compare(entry["full"], entry["lora"])
            print(f"[{shape}] lora/full: {entry['lora_over_full']}", flush=True)
    result.write({"shapes": shapes}, suffix=suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
