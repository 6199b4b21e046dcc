"""TRL's sides of ``bench.gpu.workload``: the spec each TRL run gets (the same prompts, answers and settings as
ours), the launch (``bench.peers.trl_side`` for GRPOTrainer, ``bench.peers.trl_async_side`` for AsyncGRPOTrainer against
``vllm serve``), and its rates in the same terms as ours."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu.memory import watch
from bench.gpu.workload_rates import rates
from bench.gpu.workload_task import max_model_len, problems


def trl_paths(args: argparse.Namespace) -> list[str]:
    """TRL's wheels first, then whatever makes vLLM importable here (the GPU host's unpacked tree)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [*args.trl_path, *inherited, str(common.ROOT)]


def trl_spec(args: argparse.Namespace, model_dir: Path, name: str) -> dict[str, Any]:
    todo = problems(args, args.steps * args.batch_groups)
    return {"model_dir": str(model_dir), "out_dir": str(common.CACHE / "gpu-workload" / "runs" / name),
            "prompts": [p.prompt for p in todo], "answers": [str(p.length) for p in todo], "n": args.n,
            "batch_groups": args.batch_groups, "max_tokens": args.max_tokens, "steps": args.steps, "lr": args.lr,
            "seed": args.seed, "fixed_length": False, "reward": "countdown", "use_vllm": True, "threads": None,
            "bf16": not args.cpu_smoke, "micro_batch": args.n, "save_model": False,
            "vllm_max_model_length": max_model_len(args),
            "vllm_gpu_memory_utilization": args.trl_gpu_memory_utilization, "max_staleness": args.max_staleness}


def trl_rates(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """A TRL run's rates, as ours. A run cut short (``partial``: its steps so far, ``train_s`` its last step's end)
    gets them too and stays ``partial``, so ``summarise`` keeps its ratios apart."""
    if "error" in res or "train_s" not in res:
        return res
    per_step = args.batch_groups * args.n
    lengths = [x or 0.0 for x in res.get("completion_length", [])]
    marks = res.get("step_end_s") or [res["train_s"]] * res.get("steps", 0)
    tokens = [length * per_step for length in lengths[: len(marks)]]
    tokens += [0.0] * (len(marks) - len(tokens))
    return {**res, **rates(marks, per_step, tokens, res["train_s"], args.skip_steps)}


async def run_side(args: argparse.Namespace, model_dir: Path, side: str, timeout: float) -> dict[str, Any]:
    """One of TRL's sides (``trl``, ``trl_sleep``, ``trl_async``, ``trl_lora``), killed after ``timeout`` seconds
    (what it ran by then is kept, ``partial``), its rates and peak GPU memory added."""
    from bench.peers import trl_async_side, trl_side

    memory = watch(args)
    spec = trl_spec(args, model_dir, side)
    work = common.CACHE / "gpu-workload" / "runs"
    with memory.watching():
        if side == "trl_async":
            server = ["--max-model-len", str(spec["vllm_max_model_length"]), "--max-num-seqs",
                      str(args.max_num_seqs), "--seed", str(args.seed)]
            server += [] if args.engine_compile else ["--compilation-config",
                                                      '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}']
            server += (["--dtype", "float32", "--enforce-eager"] if args.cpu_smoke else
                       ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))])
            res = await trl_async_side.launch(args.trl_python, spec, work, side, paths=trl_paths(args),
                                              timeout=timeout, server_gpu="1", trainer_gpu="0",
                                              server_args=server)
        else:
            spec["vllm_sleep"] = side == "trl_sleep"
            if side == "trl_lora":  # PEFT LoRA of ours's rank, alpha and targets, at the adapter's learning rate
                from asyncrl.lora import LoraConfig

                targets = LoraConfig().target_modules
                spec |= {"lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "target_modules": targets},
                         "lr": args.lora_lr}
            res = await asyncio.to_thread(trl_side.launch, args.trl_python, spec, work, side,
                                          paths=trl_paths(args), timeout=timeout, keep_partial=True)
    res = trl_rates(args, res)
    res["gpu_peak_used_gib"] = list(memory.peak)
    res["host"] = common.host_id()
    return res
