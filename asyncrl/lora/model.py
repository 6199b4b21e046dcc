"""A policy trained through a LoRA adapter (PEFT, the ``asyncrl[lora]`` extra): wrapping, the adapter's tensors,
the base model as the frozen reference, and export.

``apply_lora`` wraps a transformers causal LM in a PEFT model whose only trainable parameters are the adapter's;
the base weights stay where they are, frozen, and are shared: ``reference_context`` runs the same module with the
adapter switched off, which is the reference policy of a KL penalty without a second copy of the weights
(``LoraReference`` hands it to ``GRPOLoss``). ``adapter_state`` / ``load_adapter_state`` move the adapter alone,
under the names of PEFT's adapter file (what ``export_adapter`` writes, what vLLM loads); checkpoints store it
(``asyncrl.checkpoint.store``). ``merged_state`` / ``export_merged`` give the plain model with the adapter
folded in, without touching the live weights.

PEFT is imported on first use, so ``asyncrl.lora`` imports without the extra installed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.errors import ConfigError
from asyncrl.lora.config import LoraConfig

__all__ = ["LoraReference", "adapter_config", "adapter_state", "apply_lora", "export_adapter", "export_merged",
           "is_lora", "load_adapter_state", "merged_state", "reference_context"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # the optional extra
        raise ImportError("LoRA training needs PEFT: pip install 'asyncrl[lora]'") from exc
    return peft


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT-wrapped model (``apply_lora``). Never imports PEFT: a process that has not
    imported it holds no such model."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _require_lora(model: torch.nn.Module, what: str) -> Any:
    if not is_lora(model):
        raise TypeError(f"{what} needs a model wrapped by asyncrl.lora.apply_lora, got {type(model).__name__}")
    return model


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """``model`` (a transformers causal LM) wrapped with a fresh adapter per ``config``: ``B`` starts at zero, so
    the wrapped model computes exactly what ``model`` did. Only the adapter's parameters require grad. The
    adapter is created in place inside ``model``'s modules (``model`` itself is changed; do not train it
    separately). ``ConfigError`` names a target module that matches nothing."""
    peft = _peft()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in config.target_modules if t not in present]
    if missing:
        raise ConfigError("LoraConfig.target_modules", f"{missing} match no module of {type(model).__name__} "
                                                        f"(its modules include {sorted(present)[:12]}...)")
    settings = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                               lora_dropout=config.dropout, bias="none", task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, settings)
    for name, param in wrapped.named_parameters():  # PEFT's contract, checked: nothing but the adapter trains
        if param.requires_grad and ".lora_" not in name:
            raise RuntimeError(f"{name} is trainable after wrapping, but is no adapter weight")
    return wrapped


def adapter_config(model: torch.nn.Module) -> LoraConfig:
    """The shape of ``model``'s adapter (rank, alpha, targets, dropout), as ``apply_lora`` was given it."""
    settings = _require_lora(model, "adapter_config").peft_config["default"]
    targets = settings.target_modules
    return LoraConfig(rank=settings.r, alpha=settings.lora_alpha, dropout=settings.lora_dropout,
                      target_modules=tuple(sorted(targets)) if not isinstance(targets, str) else (targets,))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors alone, under the names of PEFT's adapter file (``...q_proj.lora_A.weight``). They
    share storage with the live parameters: copy them before the next optimiser step if they must not move."""
    peft = _peft()
    return dict(peft.get_peft_model_state_dict(_require_lora(model, "adapter_state"), save_embedding_layers=False))


def load_adapter_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (as ``adapter_state`` names them) into ``model``'s adapter, in place. ``ValueError``
    unless they name exactly the adapter's tensors, with their shapes."""
    peft = _peft()
    want = adapter_state(model)
    missing, unknown = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unknown:
        raise ValueError(f"adapter tensors do not match the model's adapter: missing {missing[:4]}, "
                         f"unknown {unknown[:4]}")
    for name, tensor in tensors.items():
        if tensor.shape != want[name].shape:
            raise ValueError(f"adapter tensor {name}: shape {tuple(tensor.shape)}, the model's adapter has "
                             f"{tuple(want[name].shape)} (another rank?)")
    with torch.no_grad():
        peft.set_peft_model_state_dict(model, dict(tensors))


@contextlib.contextmanager
def reference_context(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside, ``model`` computes as its base model (every adapter off): the frozen reference, with no second
    copy of the weights. Which parameters require grad is exactly as before on the way out (PEFT's own switch
    would leave every adapter trainable)."""
    wrapped = _require_lora(model, "reference_context")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with wrapped.disable_adapter():
            yield model
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


class LoraReference:
    """``GRPOLoss(ref_model=LoraReference())``: the KL penalty's reference is the policy being trained, scored
    under ``reference_context`` (its adapter disabled), i.e. the base model. Scoring a policy that has no
    adapter is an error, never a silent KL of zero."""

    def scope(self, policy: torch.nn.Module) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The module to score the reference with, valid inside the returned context."""
        return reference_context(policy)


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (its own names, ``model.embed_tokens.weight``...) with every active
    adapter folded into its base weight: ``W + (alpha / rank) B A``, summed in float32 and cast to ``W``'s
    dtype. New tensors for adapted weights; the others share storage with the live model, which is unchanged."""
    from peft.tuners.lora import LoraLayer

    base = _require_lora(model, "merged_state").get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    adapter_keys: set[str] = set()
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if module.merged:
            raise ValueError(f"{name} has its adapter merged into the base weight already")
        for attr in module.adapter_layer_names:
            adapter_keys.update(f"{name}.{attr}.{key}" for key in getattr(module, attr).state_dict())
        active = [a for a in module.active_adapters if a in module.lora_A]
        if active:
            deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a).float() for a in active)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, tensor in base.state_dict().items():
            if key in adapter_keys:
                continue
            delta = deltas.get(key)
            merged = tensor if delta is None else (tensor.float() + delta).to(tensor.dtype)
            out[key.replace(".base_layer.", ".")] = merged
    return out


def export_adapter(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Write the adapter as a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``):
    what ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loading read. Returns ``out_dir``."""
    out = Path(out_dir)
    _require_lora(model, "export_adapter").save_pretrained(str(out), save_embedding_layers=False)
    return out


def export_merged(model: torch.nn.Module, out_dir: str | Path, tokenizer: Any = None) -> Path:
    """Write the model with its adapter folded in (``merged_state``) as a plain transformers model directory,
    loadable by ``AutoModelForCausalLM`` (and vLLM) with no PEFT; with ``tokenizer``, its files beside it. The
    live model is not changed; the copy that is saved is built on the CPU. Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    base = _require_lora(model, "export_merged").get_base_model()
    weights = {k: v.detach().to("cpu", copy=True) for k, v in merged_state(model).items()}
    dtype = next(iter(weights.values())).dtype
    plain = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
    plain.load_state_dict(weights, strict=True)
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = base.generation_config
    out = Path(out_dir)
    plain.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
