"""A checkpoint's weights: the model's full state dict (tied tensors stored once), or a LoRA policy's adapter
alone (``asyncrl.lora``): its base is the model the run started from and never changes, so a checkpoint of a 7B
policy is tens of MiB instead of GiB. ``meta.json`` says which (``"weights": "adapter"``; absent: full)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.engines.weights import WEIGHTS_FILE
from asyncrl.lora.model import adapter_state, is_lora, load_adapter_state

__all__ = ["ADAPTER_FILE", "WEIGHTS_FILE", "cpu_weights", "load_weights"]

ADAPTER_FILE = "adapter.safetensors"  # instead of WEIGHTS_FILE for a LoRA policy


def cpu_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], str, dict[str, Any]]:
    """CPU copies of what a checkpoint stores of ``model``, the file to store them in, and what ``meta.json``
    records about them."""
    if is_lora(model):
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in adapter_state(model).items()}
        base = model.peft_config["default"].base_model_name_or_path  # type: ignore[index]
        return tensors, ADAPTER_FILE, {"weights": "adapter", "aliases": {}, "lora_base": str(base)}
    tensors, aliases = _cpu_state(model)
    return tensors, WEIGHTS_FILE, {"aliases": aliases}


def load_weights(path: Path, meta: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Load a checkpoint's weights into ``model`` in place. ``ValueError`` when a LoRA checkpoint meets a model
    without an adapter, or the other way round."""
    from safetensors.torch import load_file

    adapter = meta.get("weights") == "adapter"
    if adapter != is_lora(model):
        held = "a LoRA adapter" if adapter else "full weights"
        raise ValueError(f"{path} holds {held}, and the model to restore into is "
                         f"{'not ' if adapter else ''}wrapped by asyncrl.lora.apply_lora")
    tensors = load_file(str(path / (ADAPTER_FILE if adapter else WEIGHTS_FILE)))
    if adapter:
        load_adapter_state(model, tensors)
        return
    for alias, target in meta.get("aliases", {}).items():
        tensors[alias] = tensors[target]
    model.load_state_dict(tensors, strict=True)


def _cpu_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """CPU copies of the state dict; tensors sharing storage (tied weights) are stored once."""
    weights: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return weights, aliases
