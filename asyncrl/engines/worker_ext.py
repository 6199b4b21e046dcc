"""Runs inside each vLLM worker process (``worker_extension_cls``): weight reload that keeps tied weights tied.

vLLM's layerwise reload replaces each loaded layer's parameters; a layer that shares a parameter with
another (e.g. ``lm_head`` tied to ``embed_tokens``) gets nothing from the checkpoint and keeps its old
kernel tensors, so after a sync the output head would still be the old one. We record the aliases before
the first reload and point them at the new parameters afterwards, redoing the alias layer's post-load
processing (on CPU that repacks the GEMM weights the head actually uses).

Loaded by name in the worker, so keep this module light: no asyncrl imports beyond the standard library.
"""

from __future__ import annotations

from typing import Any

import torch

EXTENSION = "asyncrl.engines.worker_ext.AsyncRLWorkerExtension"


def tied_aliases(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """``(module path, attribute, canonical parameter name)`` for every parameter that aliases another."""
    canonical: dict[int, str] = {}
    aliases: list[tuple[str, str, str]] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{attr}" if mod_name else attr
            if id(param) in canonical and canonical[id(param)] != full:
                aliases.append((mod_name, attr, canonical[id(param)]))
            else:
                canonical.setdefault(id(param), full)
    return aliases


def retie(model: torch.nn.Module, aliases: list[tuple[str, str, str]]) -> None:
    for mod_name, attr, target in aliases:
        module = model.get_submodule(mod_name)
        setattr(module, attr, model.get_parameter(target))
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


class AsyncRLWorkerExtension:
    """Mixed into vLLM's worker class; methods are called through ``collective_rpc``."""

    model_runner: Any  # provided by the worker

    def asyncrl_record_ties(self) -> int:
        """Called once after start-up, while ties are still intact. Returns how many aliases exist."""
        self._asyncrl_aliases = tied_aliases(self.model_runner.get_model())
        return len(self._asyncrl_aliases)

    def asyncrl_reload(self, weights_path: str) -> None:
        """Reload every weight from ``weights_path`` (a safetensors directory) and restore ties."""
        self.model_runner.reload_weights(weights_path=weights_path)
        retie(self.model_runner.get_model(), getattr(self, "_asyncrl_aliases", []))
