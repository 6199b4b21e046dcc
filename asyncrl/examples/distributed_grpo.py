"""GRPO with an FSDP2 learner over N ranks and N vLLM servers (the addition task on a local model).

    torchrun --nproc-per-node 2 -m asyncrl.examples.distributed_grpo --model-dir DIR --servers http://127.0.0.1:8000
    torchrun --nproc-per-node 2 -m asyncrl.examples.distributed_grpo --model-dir DIR --start-servers 1   # one host
    python -m asyncrl.launch.ray --entry asyncrl.examples.distributed_grpo --model-dir DIR --servers 2 --ranks 2 \\
        -- --steps 50                                                                              # Ray

Rank 0 connects to the servers (an ``EnginePool``), runs the producers, the queue and the learner; each step
the batch is split over the ranks and the gradients summed by FSDP. Weights are gathered bucket by bucket,
staged once by rank 0 and reloaded by every server (``--transfer files``), or broadcast to each server over
vLLM's NCCL weight transfer (``--transfer nccl``, GPU servers started with
``--weight-transfer-config '{"backend": "nccl"}'``; rank 0's GPU must hold no server). Prints one JSON line
per step and a last ``done`` line. ``--checkpoint-dir`` writes sharded (DCP) checkpoints that load into any
number of ranks; ``python -m asyncrl.distributed.export CKPT --model-dir DIR --out OUT``
turns one into a Hugging Face model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUCKET_MIB = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="HF model directory the servers serve")
    p.add_argument("--servers", default=os.environ.get("ASYNCRL_SERVERS", ""),
                   help="comma-separated server URLs (default: $ASYNCRL_SERVERS)")
    p.add_argument("--served-model", help="the name the servers serve the model under (default: --model-dir)")
    p.add_argument("--start-servers", type=int, default=0, help="rank 0 starts this many local servers itself")
    p.add_argument("--server-args", default="", help="extra vLLM server flags for --start-servers")
    p.add_argument("--steps", type=int, default=10, help="total optimiser steps (a resumed run continues to it)")
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--micro-batch-rollouts", type=int, default=64)
    p.add_argument("--packing", choices=("off", "rows", "varlen"), default="off",
                   help="pack rows (LearnerConfig.packing); varlen: and attend through varlen kernels")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--reward", choices=("exact", "digits"), default="exact",
                   help="exact: the sum; digits: the share of digit characters (a dense signal for smoke runs)")
    p.add_argument("--transfer", choices=("files", "nccl"), default="files")
    p.add_argument("--bucket-mib", type=float, default=BUCKET_MIB, help="gather buffer for publication")
    p.add_argument("--dtype", default="float32", help="learner dtype (the servers keep their own)")
    p.add_argument("--optimizer", choices=("adamw", "adamw_bf16"), default="adamw",
                   help="LearnerConfig.optimizer; adamw_bf16 (with --dtype bfloat16): bf16 states, stochastic rounding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, help="write DCP checkpoints step-NNNNNN here")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", type=Path, help="a sharded checkpoint to continue from (saved at any number of ranks)")
    return p.parse_args(argv)


def setup(args: argparse.Namespace, ctx: Any) -> Any:
    """Every rank: the model (same start everywhere), sharded; AdamW over the shards (``--optimizer``); the GRPO
    loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.distributed import FSDPBackend, load_sharded, shard_model
    from asyncrl.engines.weights import manifest_dtype, read_manifest
    from asyncrl.actors.optimizer import StochasticAdamW

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=getattr(torch, args.dtype))
    model = shard_model(model, ctx)
    config = learner_config(args)
    # Either with torch's AdamW defaults (weight decay 0.01), which this example has always trained with.
    adamw = StochasticAdamW if config.optimizer == "adamw_bf16" else torch.optim.AdamW
    optimizer = adamw(model.parameters(), lr=args.lr)
    if args.resume:  # every rank reads its own shards, whatever the number of ranks that saved them
        load_sharded(args.resume, model, optimizer)
    return FSDPBackend(model, optimizer, make_loss(args), config, ctx,
                       publish_dtype=manifest_dtype(read_manifest(args.model_dir)),
                       bucket_bytes=int(args.bucket_mib * 2**20))


def make_loss(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    from asyncrl.algorithms.losses import GRPOLoss, LossConfig

    pad_id = AutoTokenizer.from_pretrained(str(args.model_dir)).pad_token_id or 0
    return GRPOLoss(LossConfig(), sampling=sampling_config(args), pad_id=pad_id)


def learner_config(args: argparse.Namespace) -> Any:
    from asyncrl import LearnerConfig, SyncConfig

    return LearnerConfig(batch_groups=args.batch_groups, lr=args.lr, micro_batch_rollouts=args.micro_batch_rollouts,
                         packing=args.packing != "off", varlen_attention=args.packing == "varlen",
                         optimizer=args.optimizer,
                         sync=SyncConfig(every=1, mode="keep"))


def sampling_config(args: argparse.Namespace) -> Any:
    from asyncrl import SamplingConfig

    return SamplingConfig(n=args.group_size, max_tokens=args.max_tokens, seed=args.seed)


def pipeline_config(args: argparse.Namespace) -> Any:
    from asyncrl import PipelineConfig, ProducerConfig, QueueConfig

    sampling = sampling_config(args)
    capacity = args.batch_groups * (args.max_staleness + 1)
    return PipelineConfig(producer=ProducerConfig(sampling=sampling, max_inflight_groups=args.batch_groups),
                          queue=QueueConfig(capacity=capacity, max_staleness=args.max_staleness),
                          learner=learner_config(args), num_producers=args.producers,
                          progress=False)  # one JSON line per step on stdout already


def prompts(args: argparse.Namespace) -> Iterator[Any]:
    from transformers import AutoTokenizer

    from asyncrl import Prompt
    from asyncrl.testing.tasks import arithmetic

    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    for i, problem in enumerate(arithmetic.problems(args.seed)):
        yield Prompt(f"p{i}", tuple(tok(problem.prompt, add_special_tokens=False).input_ids), problem.prompt,
                     problem.answer)


def reward_fn(args: argparse.Namespace) -> Any:
    from asyncrl.testing.tasks import arithmetic

    if args.reward == "digits":
        return lambda prompt, sample: sum(c.isdigit() for c in sample.text) / max(1, len(sample.text))
    return lambda prompt, sample: arithmetic.reward(sample.text, prompt.answer)


async def connect(args: argparse.Namespace, urls: list[str], local_rank: int) -> Any:
    """An ``EnginePool`` over the servers. Rank 0's staged buckets reach them as they are: each server reloads
    the files (``--transfer files``) or has them broadcast one tensor at a time (``nccl``)."""
    from asyncrl.engines.pool import EnginePool
    from asyncrl.engines.vllm_remote import NcclTransportConfig, RemoteEngineConfig, RemoteVLLMEngine, free_port

    engines = []
    for i, url in enumerate(urls):
        nccl = None
        if args.transfer == "nccl":
            # The server's workers join rank 0's rendezvous: at the address the launcher gave rank 0.
            nccl = NcclTransportConfig(master_port=free_port(), device=f"cuda:{local_rank}",
                                       master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"))
        cfg = RemoteEngineConfig(base_url=url, model=args.served_model or str(args.model_dir),
                                 model_dir=str(args.model_dir), nccl=nccl)
        engines.append(await RemoteVLLMEngine.connect(cfg, name=f"server-{i}"))
    return EnginePool(engines)


async def lead(args: argparse.Namespace, backend: Any, hooks: list[Any] = ()) -> dict[str, Any]:
    """Rank 0: servers (started here with --start-servers), pool, pipeline, run."""
    import contextlib

    from asyncrl.engines.vllm_remote import free_port, start_vllm_server

    async with contextlib.AsyncExitStack() as stack:
        urls = [u for u in args.servers.split(",") if u]
        for _ in range(args.start_servers):
            server = await stack.enter_async_context(start_vllm_server(
                args.model_dir, free_port(), extra_args=args.server_args.split()))
            urls.append(server.base_url)
        if not urls:
            raise SystemExit("no servers: give --servers, $ASYNCRL_SERVERS or --start-servers")
        pool = await connect(args, urls, backend.ctx.local_rank)
        return await train(args, backend, pool, hooks)


async def train(args: argparse.Namespace, backend: Any, pool: Any, hooks: list[Any]) -> dict[str, Any]:
    from asyncrl.checkpoint.resume import continue_books
    from asyncrl.checkpoint.store import restored_counters
    from asyncrl.data import PromptSource
    from asyncrl.distributed import read_meta, sharded_pipeline
    from asyncrl.groups import RewardGroups

    meta = read_meta(args.resume) if args.resume else {"step": 0, "cursor": 0}
    source = PromptSource(prompts(args), start=meta["cursor"])
    pipe = sharded_pipeline(pool, backend, source, RewardGroups(reward_fn(args)), pipeline_config(args),
                            step=meta["step"])
    learner = pipe.learner
    if args.resume:
        if "counters" in meta:  # the group accounting goes on where it stopped
            continue_books(pipe, restored_counters(meta))
        # The servers start from the model directory: serve the restored weights, as a version never seen.
        await learner.publish(meta["version"] + 1)

    async def report(step: int, metrics: dict[str, float]) -> None:
        emit("step", step=step, version=learner.version, loss=metrics.get("loss/total"),
             reward_mean=metrics.get("train/reward_mean"), staleness=metrics.get("rollout/staleness_batch_mean"),
             train_s=metrics.get("learner/train_s"), sync_s=metrics.get("sync/total_s"))
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            await checkpoint(args, learner, source, step)

    learner.hooks.extend([*hooks, report])
    result = await pipe.run(args.steps)
    summary = {"steps": result.steps, "version": result.version, "wall_s": result.wall_s,
               "groups_trained": result.groups_trained, "dropped": result.dropped, "sync_s": result.sync_s,
               "train_s": result.train_s, "ranks": backend.ctx.world_size, "servers": len(pool.live),
               "prompts_issued": source.cursor}  # every one of them trained or dropped, this run and before
    emit("done", **summary)
    return summary


async def checkpoint(args: argparse.Namespace, learner: Any, source: Any, step: int) -> None:
    import asyncio

    from asyncrl.checkpoint.resume import training_state
    from asyncrl.checkpoint.store import state_meta
    from asyncrl.distributed.checkpoint import save_backend

    await learner.flush()  # the version recorded is the one served
    path = args.checkpoint_dir / f"step-{step:06d}"
    # Groups queued or being generated now are not replayed on resume: the prompts continue at the cursor, and
    # those groups are counted as unused there.
    meta = {**state_meta(training_state(learner, source)), "model_dir": str(args.model_dir)}
    await asyncio.to_thread(learner.backend.call, functools.partial(save_backend, path=str(path), meta=meta))


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> Any:
    import logging

    from asyncrl.distributed import run_ranks

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    return run_ranks(functools.partial(setup, args), functools.partial(lead, args))


if __name__ == "__main__":
    main()
