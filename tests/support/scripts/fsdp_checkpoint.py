"""2 FSDP ranks (torchrun) train 2 steps, save a sharded (DCP) checkpoint, then take a third step; rank 0 writes
the full weights after steps 2 and 3 (``OUT/step2``, ``OUT/step3``) for tests/distributed/test_distributed.py to
compare a 1-process resume against.

    torchrun --nproc-per-node 2 tests/support/scripts/fsdp_checkpoint.py MODEL_DIR OUT
"""

from __future__ import annotations

import asyncio
import functools
import random
import shutil
import sys
from pathlib import Path

import torch

from asyncrl.config import LearnerConfig
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan

LR = 1e-3
CONFIG = LearnerConfig(micro_batch_rollouts=2)


def batches(seed: int = 0) -> list[list[RolloutGroup]]:
    """Three batches of 3 groups x 3 rollouts with mixed rewards (so every group has a gradient)."""
    rng = random.Random(seed)
    out = []
    for b in range(3):
        groups = []
        for g in range(3):
            rollouts = []
            for r in range(3):
                tokens = tuple(rng.randrange(3, 90) for _ in range(rng.randint(2, 6)))
                sample = Sample(tokens, tuple(-2.0 for _ in tokens), FinishReason.LENGTH,
                                (VersionSpan(0, 0, len(tokens)),))
                rollouts.append(Rollout(sample, float(r == g % 3)))
            prompt = Prompt(f"b{b}g{g}", tuple(rng.randrange(3, 90) for _ in range(4)))
            groups.append(RolloutGroup(f"b{b}g{g}", prompt, tuple(rollouts)))
        out.append(groups)
    return out


def loss():  # type: ignore[no-untyped-def]
    from asyncrl.algorithms.losses import GRPOLoss, LossConfig

    return GRPOLoss(LossConfig(), pad_id=0)


def setup(model_dir: str, ctx):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from asyncrl.distributed import FSDPBackend, shard_model

    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ctx)
    return FSDPBackend(model, torch.optim.AdamW(model.parameters(), lr=LR), loss(), CONFIG, ctx)


async def lead(out: Path, backend):  # type: ignore[no-untyped-def]
    from asyncrl.distributed.checkpoint import save_backend

    steps = batches()
    for i in range(2):
        await asyncio.to_thread(backend.train_step, steps[i], i)
    await asyncio.to_thread(backend.call, functools.partial(save_backend, path=str(out / "ckpt"),
                                                            meta={"step": 2, "version": 2}))
    await asyncio.to_thread(keep_weights, backend, out / "step2")
    await asyncio.to_thread(backend.train_step, steps[2], 2)
    await asyncio.to_thread(keep_weights, backend, out / "step3")


def keep_weights(backend, where: Path) -> None:  # type: ignore[no-untyped-def]
    staged = backend.publication_state()
    shutil.copytree(staged.buckets.staged.path, where)
    backend.release(staged)


def main() -> None:
    from asyncrl.distributed import run_ranks

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    run_ranks(functools.partial(setup, model_dir), functools.partial(lead, out))


if __name__ == "__main__":
    main()
