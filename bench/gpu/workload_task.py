"""The task and policy of ``bench.gpu.workload``: the countdown task at full or smoke scale, its prompts, and the
warm-started policy both sides start from (built and warm-started in their own processes, cached by recipe)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu import countdown

# Supervised warm-start steps, at most (it stops at 99.8% accuracy). The planted shapes (``countdown.is_planted``)
# are not warm-started: too large to train within one device call.
WARM_STEPS = {"qwen2-0.5b": 200, "qwen2-1.5b": 150, "tiny": 200}
RECIPE_VERSION = 2  # 2: the tokenizer holds numbers up to countdown.WORDS


def add_task_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-answer", type=int, default=countdown.MAX_L, help="longest answer, in words (tokens)")
    p.add_argument("--mean-answer", type=float, default=countdown.MEAN_L, help="mean answer length (lognormal)")
    p.add_argument("--token-error", type=float, default=1e-3,
                   help="planted shapes: the chance that sampling picks a wrong token at each answer position")


def task_scale(args: argparse.Namespace) -> dict[str, Any]:
    """Answer lengths and prompt lengths: the run's, or small ones for the CPU smoke run."""
    if args.cpu_smoke:
        return {"max_len": 32, "mean_len": None, "prompt_range": (12, 24)}
    return {"max_len": args.max_answer, "mean_len": args.mean_answer, "prompt_range": (100, 300)}


def prepare_model(args: argparse.Namespace, shape: str) -> tuple[Path, dict[str, Any]]:
    """The policy both sides start from, cached by recipe: planted, or built and then warm-started, each in its
    own process (a 0.5B model built in the process that then starts vLLM stalled its start-up once on the H200)."""
    if countdown.is_planted(shape):
        return plant_model(args, shape)
    import subprocess

    scale = task_scale(args)
    steps = args.warm_start_steps or WARM_STEPS[shape]
    recipe = {"shape": shape, "seed": args.seed, "steps": steps, "batch": args.warm_batch, "lr": args.warm_lr,
              "max_len": scale["max_len"], "version": RECIPE_VERSION}
    base = common.CACHE / "gpu-workload" / f"{shape}-base-v{RECIPE_VERSION}"

    def build(out: Path) -> dict[str, Any]:
        py = [sys.executable, "-m", "bench.gpu.countdown"]
        if not (base / "config.json").exists():
            subprocess.run([*py, "build", str(base), "--shape", shape, "--seed", str(args.seed)], check=True)
        done = subprocess.run([*py, "warm", str(base), str(out), "--steps", str(steps), "--batch",
                               str(args.warm_batch), "--lr", str(args.warm_lr), "--seed", str(args.seed),
                               "--max-len", str(scale["max_len"]), "--prompt-range",
                               *map(str, scale["prompt_range"])], check=True, stdout=subprocess.PIPE, text=True)
        line = next(x for x in done.stdout.splitlines() if x.startswith("WARM "))
        return json.loads(line[5:])

    t0 = time.perf_counter()
    out, info = common.cached_build(common.CACHE / "gpu-workload" / f"{shape}-warm", recipe, build)
    return out, {**info, "prepare_s": time.perf_counter() - t0, "params": common.param_count(out)}


def plant_model(args: argparse.Namespace, shape: str) -> tuple[Path, dict[str, Any]]:
    """A planted policy of ``shape`` (its own process: the device's memory is whole again for the engine)."""
    import subprocess

    recipe = {"shape": shape, "seed": args.seed, "token_error": args.token_error, "version": RECIPE_VERSION,
              "planted": True}

    def build(out: Path) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-m", "bench.gpu.planted", str(out), "--shape", shape, "--seed",
                               str(args.seed), "--token-error", str(args.token_error)], check=True,
                              stdout=subprocess.PIPE, text=True)
        return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("PLANTED "))[8:])

    t0 = time.perf_counter()
    out, info = common.cached_build(common.CACHE / "gpu-workload" / f"{shape}-planted", recipe, build)
    return out, {**info, "warm_start": "planted", "prepare_s": time.perf_counter() - t0,
                 "params": common.param_count(out)}


def problems(args: argparse.Namespace, count: int) -> list[Any]:
    """The run's first ``count`` problems: the same list for every side."""
    scale = task_scale(args)
    return countdown.problems(args.seed, count, max_len=scale["max_len"], prompt_range=scale["prompt_range"],
                              mean_len=scale["mean_len"])


def max_model_len(args: argparse.Namespace) -> int:
    """Every side's engine context: the longest prompt, the longest completion and one token more."""
    return common.context_len(task_scale(args)["prompt_range"][1] + args.max_tokens + 1)


def task_prompts(args: argparse.Namespace, tok: Any, count: int) -> list[Any]:
    from asyncrl import Prompt

    return [Prompt(f"p{i}", tuple(tok(p.prompt, add_special_tokens=False).input_ids), p.prompt, p.length)
            for i, p in enumerate(problems(args, count))]
