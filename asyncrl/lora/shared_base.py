"""A LoRA learner's frozen base held once, in its engine: ``share_base`` points every frozen parameter of the
policy at the weights the engine serves (``BaseLender.lend_base``), so learner and engine on one GPU hold the
base once instead of twice (14.2 GiB saved at 7B in bfloat16).

The engine names its parameters its own way. A parameter is found under the policy's name (the ``base_layer``
levels that PEFT's and vLLM's LoRA layers add, and PEFT's outer wrapping, taken off on both sides), or inside the
fused module that stacks it by rows (``qkv_proj`` stacks ``q_proj``, ``k_proj``, ``v_proj``: each is a row slice,
at the offset its predecessors' rows add up to); the embedding and the output head may have more rows in the
engine (its vocabulary padding), and take the first ones. Shapes and dtypes must match exactly otherwise. Every
frozen parameter is mapped before any is replaced, so a refusal leaves the policy as it was.

The lent weights are read-only by contract: nothing in asyncrl writes a frozen parameter (``merged_state`` builds
new tensors), and the engine never rewrites them while it serves adapters. They live in the engine: once it is
closed, the policy must not run again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncrl.errors import ConfigError
from asyncrl.lora.model import _require_lora

PADDED = ("embed_tokens.weight", "lm_head.weight")  # vocabulary rows the engine may pad


@dataclass(frozen=True, slots=True)
class LentBase:
    """An engine's weights mapped into this process, read-only by contract, valid while that engine runs
    (``engines.protocols.BaseLender.lend_base``)."""

    engine: str
    tensors: Mapping[str, torch.Tensor]  # the engine's own names (``...qkv_proj.weight``), tied weights once
    packed: Mapping[str, tuple[str, ...]]  # fused module -> the checkpoint modules it stacks by rows, in order


class LentParameter(torch.nn.Parameter):
    """A policy's frozen parameter over a ``LentBase`` tensor: its memory is the engine's, so the learner's memory
    plan leaves it out (``actors.memory``)."""


def engine_name(name: str) -> str:
    """``name`` without the wrapping levels: PEFT's ``base_model.model.`` in front, PEFT's and vLLM's
    ``base_layer.`` inside."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def share_base(model: torch.nn.Module, lent: LentBase) -> int:
    """Point every frozen parameter of ``model`` (``apply_lora``'s) at ``lent``'s, and move the rest (the adapter,
    buffers) to ``lent``'s device. Tied parameters stay tied. Returns the bytes of base weights the learner no
    longer holds. ``ConfigError`` names a parameter the engine does not hold, or holds in another shape or
    dtype; nothing is replaced then."""
    _require_lora(model, "share_base")
    # vLLM's LoRA layers wrap the base layer as PEFT's do: both sides' names lose their ``base_layer`` level.
    lent = LentBase(lent.engine, {engine_name(n): t for n, t in lent.tensors.items()}, lent.packed)
    params = {engine_name(name): p for name, p in model.named_parameters() if not p.requires_grad}  # tied: once
    shared = {id(param): LentParameter(_view(name, param, params, lent), requires_grad=False)
              for name, param in params.items()}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) in shared:
                setattr(module, attr, shared[id(param)])
    if shared:  # the adapter and the buffers; the lent parameters are there already
        model.to(next(iter(shared.values())).device)
    return sum(p.numel() * p.element_size() for p in params.values())


def _view(name: str, param: torch.Tensor, params: dict[str, torch.Tensor], lent: LentBase) -> torch.Tensor:
    """The part of ``lent``'s tensors that is ``param`` (named ``name``, without PEFT's levels)."""
    source, rows = _locate(name, params, lent)
    start, stop = rows if rows is not None else (0, source.shape[0])
    if rows is None and name.endswith(PADDED) and source.shape[0] > param.shape[0]:
        stop = param.shape[0]
    view = source[start:stop]
    if tuple(view.shape) != tuple(param.shape):
        raise ConfigError("share_base", f"parameter {name}: the policy's is {tuple(param.shape)}, engine "
                                        f"{lent.engine} holds {tuple(view.shape)}: not the model it serves")
    if view.dtype != param.dtype:
        raise ConfigError("share_base", f"parameter {name}: the policy's is {param.dtype}, engine {lent.engine} "
                                        f"serves {view.dtype}: load the policy's base in the engine's dtype")
    return view


def _locate(name: str, params: dict[str, torch.Tensor], lent: LentBase) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """The lent tensor holding ``name`` and, where a fused module stacks it, its rows there."""
    if name in lent.tensors:
        return lent.tensors[name], None
    module, _, attr = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in lent.packed.items():
        if leaf not in parts or (key := f"{parent}.{fused}.{attr}") not in lent.tensors:
            continue
        sizes = []
        for part in parts:
            sibling = params.get(f"{parent}.{part}.{attr}")
            if sibling is None:
                raise ConfigError("share_base", f"parameter {name}: engine {lent.engine} stacks it in {key} with "
                                                f"{parent}.{part}.{attr}, which the policy lacks")
            sizes.append(sibling.shape[0])
        if sum(sizes) != lent.tensors[key].shape[0]:
            raise ConfigError("share_base", f"parameter {name}: engine {lent.engine}'s {key} has "
                                            f"{lent.tensors[key].shape[0]} rows, not the {sum(sizes)} of {parts}")
        start = sum(sizes[:parts.index(leaf)])
        return lent.tensors[key], (start, start + sizes[parts.index(leaf)])
    raise ConfigError("share_base", f"parameter {name}: engine {lent.engine} holds no such weight, alone or "
                                    f"stacked (its fused modules: {sorted(lent.packed)})")
