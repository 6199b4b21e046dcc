"""A rank of the 2-rank FSDP learner used by tests/distributed/test_distributed.py (run under torchrun).

    torchrun --nproc-per-node 2 tests/support/scripts/fsdp_learner.py --model-dir DIR --servers URL --out OUT
    torchrun --nproc-per-node 2 tests/support/scripts/fsdp_learner.py --model-dir DIR --fake --out OUT   (kill test)

Rank 0 records every batch it trains on (``OUT/batches.pkl``) and each step's metrics; at the end it gathers
the final weights once more (``OUT/final/``) and asks the server for the log-probs of fixed sequences
(``OUT/result.json``), with the engine still holding the last publication. Every rank writes its pid, and
once ``run_ranks`` has returned, whether its control group is freed and which threads are left
(``OUT/rankN.exit.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import pickle
import shutil
import sys
import threading
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from asyncrl.examples import distributed_grpo as example  # noqa: E402
from asyncrl.groups import RewardGroups

SEQS = [[1, 5, 17, 33, 9, 60, 61, 4, 21, 88, 3, 44], [1, 70, 2, 71, 15, 15, 15, 90, 6, 7, 8, 9]]


def record(backend, out: Path, batches: list) -> None:
    step = backend.train_step

    def recorded(batch, n):  # type: ignore[no-untyped-def]
        batches.append(list(batch))
        metrics = step(batch, n)
        (out / "batches.pkl").write_bytes(pickle.dumps(batches))
        return metrics

    backend.train_step = recorded


async def lead(args: argparse.Namespace, out: Path, backend) -> dict:  # type: ignore[no-untyped-def]
    from asyncrl.distributed import sharded_pipeline
    from asyncrl.engines.fake import FakeEngine

    batches: list = []
    record(backend, out, batches)
    if args.fake:
        pool = FakeEngine(token_delay_s=0.001)
    else:
        pool = await example.connect(args, args.servers.split(","), backend.ctx.local_rank)
    losses: list[float] = []
    norms: list[float] = []
    pipe = sharded_pipeline(pool, backend, example.prompts(args), RewardGroups(example.reward_fn(args)),
                            example.pipeline_config(args), close_engine=False)
    pipe.learner.hooks.append(lambda step, m: (losses.append(m["loss/total"]), norms.append(m["train/grad_norm"]),
                                               print(json.dumps({"event": "step", "step": step}), flush=True)))
    try:
        result = await pipe.run(args.steps)
        final = await asyncio.to_thread(backend.publication_state)  # every rank gathers; rank 0 stages
        shutil.copytree(final.buckets.staged.path, out / "final")
        backend.release(final)
        logprobs = [] if args.fake else [await pool._members[0].engine.prompt_logprobs(s) for s in SEQS]
    finally:
        await pool.close()
    doc = {"steps": result.steps, "version": result.version, "losses": losses, "grad_norms": norms,
           "engine_logprobs": logprobs, "attention": backend.model.config._attn_implementation}
    (out / "result.json").write_text(json.dumps(doc))
    return doc


def main() -> None:
    from asyncrl.distributed import run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fake", action="store_true")
    known, rest = p.parse_known_args()
    args = example.parse_args(rest)
    args.fake = known.fake
    known.out.mkdir(parents=True, exist_ok=True)
    (known.out / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    control: list[weakref.ref] = []

    def setup(ctx):  # type: ignore[no-untyped-def]
        control.append(weakref.ref(ctx.control))
        return example.setup(args, ctx)

    run_ranks(setup, functools.partial(lead, args, known.out))
    left = {"control_group_freed": control[0]() is None, "threads": [t.name for t in threading.enumerate()]}
    (known.out / f"rank{os.environ['RANK']}.exit.json").write_text(json.dumps(left))


if __name__ == "__main__":
    main()
