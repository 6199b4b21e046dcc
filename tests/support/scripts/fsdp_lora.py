"""2 FSDP ranks (torchrun) train a LoRA policy (``shard_model(..., lora=...)``) for tests/distributed/test_fsdp_lora.py.

    torchrun --nproc-per-node 2 tests/support/scripts/fsdp_lora.py MODEL_DIR OUT

Each rank seeds its adapter differently (``shard_model`` must start every rank from rank 0's). Rank 0 trains
steps 0 and 1, saves a sharded checkpoint (``OUT/ckpt``), trains step 2, then every rank replaces its model and
optimiser with fresh ones (another adapter seed) read from the checkpoint, as a restarted run would, and step 2
is taken again. Rank 0 writes the adapter's full tensors after steps 2 and 3 of both legs (``OUT/adapters.safetensors``,
keys ``<leg>/<step>/<name>``), each step's metrics and the refusal of an optimiser over the whole model
(``OUT/result.json``). Every rank writes what its optimiser holds, which parameters are sharded and whether the
base moved (``OUT/rankN.json``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from asyncrl.algorithms import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.lora import LoraConfig, LoraReference  # noqa: E402
from asyncrl.recipes import default_optimizer  # noqa: E402
from tests.support.scripts.fsdp_checkpoint import batches  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8)
LEARNER = LearnerConfig(lr=1e-3, micro_batch_rollouts=2)
ADAPTER_SEED = 7  # rank 0's; a single process seeds the same before apply_lora to start from the same adapter


PROBE = (3, 4, 5, 6, 7, 8, 9)  # a sequence the probe scores after the third step

def loss() -> GRPOLoss:
    """GRPO with a KL term against the base model (the policy with its adapter off, under FSDP too)."""
    return GRPOLoss(LossConfig(kl_coef=0.05), ref_model=LoraReference(), pad_id=0)


def build(model_dir: str, ctx, seed: int):  # type: ignore[no-untyped-def]
    """Every rank: the base model, a LoRA adapter seeded by ``seed`` + rank, sharded; the default optimiser."""
    from transformers import AutoModelForCausalLM

    from asyncrl.distributed import shard_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed + ctx.rank)
    model = shard_model(base, ctx, lora=LORA)
    return model, default_optimizer(model, LEARNER)


def setup(model_dir: str, out: Path, ctx):  # type: ignore[no-untyped-def]
    from asyncrl.distributed import FSDPBackend

    model, optimizer = build(model_dir, ctx, ADAPTER_SEED)
    base = {n: p.detach().to_local().clone() for n, p in model.named_parameters() if not p.requires_grad}
    torch.save(base, out / f"rank{ctx.rank}.base.pt")
    return FSDPBackend(model, optimizer, loss(), LEARNER, ctx)


def restart(backend, model_dir: str, path: str) -> None:  # type: ignore[no-untyped-def]
    """Every rank: a fresh model and optimiser (another adapter) loaded from the checkpoint at ``path``."""
    from asyncrl.distributed import load_sharded

    model, optimizer = build(model_dir, backend.ctx, ADAPTER_SEED + 100)
    load_sharded(path, model, optimizer)
    backend.model, backend.optimizer = model, optimizer


def report(backend, out: str) -> None:  # type: ignore[no-untyped-def]
    """Every rank: which parameters its optimiser holds, which are sharded, what the frozen base did."""
    from torch.distributed.tensor import DTensor

    model, rank = backend.model, backend.ctx.rank
    names = {id(p): n for n, p in model.named_parameters()}
    base = torch.load(Path(out) / f"rank{rank}.base.pt")
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    doc = {
        "held": sorted(names[id(p)] for g in backend.optimizer.param_groups for p in g["params"]),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "frozen": len(frozen),
        "not_sharded": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
        "frozen_with_grad": [n for n, p in frozen.items() if p.grad is not None],
        "base_moved": max(float((p.to_local() - base[n]).abs().max()) for n, p in frozen.items()),
        "state_keys": sorted({k for s in backend.optimizer.state.values() for k in s}),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(doc))


async def lead(model_dir: str, out: Path, backend) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    from asyncrl.distributed import FSDPBackend
    from asyncrl.distributed.checkpoint import save_backend

    try:  # an optimiser over the whole model is refused before anything is sharded or gathered
        FSDPBackend(backend.model, torch.optim.AdamW(backend.model.parameters()), loss(), LEARNER, backend.ctx)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    run = asyncio.to_thread
    steps, metrics, adapters = batches(), {"first": [], "resumed": []}, {}

    sources: list[str] = []

    async def step(leg: str, n: int) -> None:
        metrics[leg].append(await run(backend.train_step, steps[n], n))
        source = await run(backend.publication_state)  # what the learner publishes: the adapter alone
        sources.append(f"{type(source).__name__} rank {source.config.rank}")
        adapters.update({f"{leg}/{n + 1}/{k}": v for k, v in source.tensors.items()})

    for n in range(3):
        await step("first", n)
        if n == 1:
            await run(backend.call, functools.partial(save_backend, path=str(out / "ckpt"), meta={"step": 2}))
    probe = await run(backend.score, PROBE)  # the publication probe's learner side: a collective forward
    await run(backend.call, functools.partial(report, out=str(out)))
    await run(backend.call, functools.partial(restart, model_dir=model_dir, path=str(out / "ckpt")))
    adapters.update({f"resumed/2/{k}": v for k, v in (await run(backend.adapter_publication_state)).items()})
    await step("resumed", 2)
    save_file(adapters, str(out / "adapters.safetensors"))
    (out / "result.json").write_text(json.dumps({"metrics": metrics, "refused": refused, "sources": sources,
                                                 "probe": probe}))


def main() -> None:
    from asyncrl.distributed import run_ranks

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    run_ranks(functools.partial(setup, model_dir, out), functools.partial(lead, model_dir, out))


if __name__ == "__main__":
    main()
