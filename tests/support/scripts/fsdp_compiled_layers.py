"""A rank of the 2-rank check that ``LearnerConfig(compile_layers=True)`` keeps an FSDP2-sharded step (run under
torchrun by tests/distributed/test_distributed.py). Two copies of one tiny Qwen2 are sharded alike; one is
compiled layer by layer. Both take the learner's accumulation over the same packed varlen micro-batches; each rank
writes the two losses, the largest gradient difference (full tensors) and whether every layer was compiled to
``OUT/rankN.json``.

    torchrun --nproc-per-node 2 tests/support/scripts/fsdp_compiled_layers.py OUT
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from asyncrl.actors.training import Chunk, accumulate, prepare_model  # noqa: E402
from asyncrl.algorithms import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.config import LearnerConfig  # noqa: E402
from asyncrl.distributed.fsdp import shard_model  # noqa: E402
from asyncrl.distributed.ranks import close_ranks, init_ranks  # noqa: E402
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan  # noqa: E402


def groups() -> list[RolloutGroup]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for g in range(3):
        prompt = Prompt(f"g{g}", tuple(torch.randint(1, 64, (2 + 3 * g,), generator=gen).tolist()))
        rollouts = []
        for i in range(4):
            ids = tuple(torch.randint(1, 64, (1 + (5 * i + g) % 9,), generator=gen).tolist())
            sample = Sample(ids, (-1.0,) * len(ids), FinishReason.LENGTH, (VersionSpan(0, 0, len(ids)),))
            rollouts.append(Rollout(sample, float(i % 2)))
        out.append(RolloutGroup(f"g{g}", prompt, tuple(rollouts)))
    return out


def step(model: torch.nn.Module, config: LearnerConfig, batch: list[RolloutGroup]) -> tuple[float, torch.Tensor]:
    prepare_model(model, config)
    parts = [Chunk(batch[:2]), Chunk(batch[2:])]
    total = sum(g.num_tokens for g in batch)
    # reduce-scatter after the last micro-batch only, as FSDPBackend has it
    loss, _ = accumulate(model, GRPOLoss(LossConfig()), parts, total_tokens=total, active_groups=len(batch),
                         config=config, grad_sync=model.set_requires_gradient_sync)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return loss, torch.cat([g.flatten() for g in grads])


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(sys.argv[1])
    ctx = init_ranks()
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    eager, compiled = (shard_model(copy.deepcopy(base), ctx) for _ in range(2))
    eager_loss, eager_grad = step(eager, LearnerConfig(packing=True, varlen_attention=True), groups())
    loss, grad = step(compiled, LearnerConfig(packing=True, varlen_attention=True, compile_layers=True), groups())
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({
        "losses": [eager_loss, loss], "max_grad_diff": float((grad - eager_grad).abs().max()),
        "grad_norm": float(eager_grad.norm()),
        "layers_compiled": [layer._compiled_call_impl is not None for layer in compiled.model.layers]}))
    close_ranks()


if __name__ == "__main__":
    main()
