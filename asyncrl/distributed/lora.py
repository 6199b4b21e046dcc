"""LoRA under FSDP2: a PEFT-wrapped policy sharded like any other (``shard_model(..., lora=LoraConfig(...))``).

The adapter is created before sharding and its initial tensors are broadcast from rank 0 (``same_adapter``), so
every rank starts from one adapter whatever its random state. ``fully_shard`` then shards each block's frozen base
weights and its adapter alike: FSDP2 all-gathers every parameter of a block for the forward but reduce-scatters
only the gradients of those that require grad, so the base stays frozen and holds no gradient. The optimiser
must hold the adapter alone (``check_optimizer``; ``asyncrl.recipes.default_optimizer`` builds one).
``full_adapter_state`` gathers the adapter's full tensors under PEFT's adapter-file names, for publication;
sharded checkpoints store the adapter and its optimiser state alone (``asyncrl.distributed.checkpoint``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from asyncrl.lora.model import adapter_state

__all__ = ["check_optimizer", "full_adapter_state", "same_adapter"]


def same_adapter(model: torch.nn.Module) -> None:
    """Every rank: overwrite this rank's adapter parameters (those that require grad) with rank 0's, in place.
    ``model`` is not sharded yet and sits on its rank's device."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                dist.broadcast(param.data, src=0)


def check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` unless ``optimizer`` holds exactly the parameters of ``model`` that require grad (the
    adapter's): a frozen base parameter in it would carry optimiser state for nothing, and a missing adapter
    parameter would never train."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = dict(model.named_parameters())
    frozen = sorted(n for n, p in params.items() if not p.requires_grad and id(p) in held)
    untrained = sorted(n for n, p in params.items() if p.requires_grad and id(p) not in held)
    if frozen or untrained:
        raise ValueError(f"the optimiser of a LoRA model must hold its adapter alone: it holds {len(frozen)} frozen "
                         f"parameters {frozen[:3]} and misses {len(untrained)} adapter parameters "
                         f"{untrained[:3]}; build it with asyncrl.recipes.default_optimizer")


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A collective (every rank calls it, in step): the adapter's full tensors as new CPU tensors, on every rank,
    under the names ``asyncrl.lora.adapter_state`` gives the unsharded model (``...q_proj.lora_A.weight``).
    Gathers one tensor at a time, in the same order on every rank (the module order)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in adapter_state(model).items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor shard: gather
        out[name] = full.detach().to("cpu", copy=True)  # a new tensor even where the gather returned the shard
    return out
