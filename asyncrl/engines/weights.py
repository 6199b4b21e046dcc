"""Checks and staging for weight updates, shared by the in-process and remote vLLM engines.

An update is validated against the engine's parameter manifest *before* anything reaches the engine, so
a bad update (missing or unknown names, wrong shapes, NaN) is refused with nothing half-applied.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.engines.base import WeightUpdateError

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "F32", "BF16"


def read_manifest(model_dir: str | Path) -> dict[str, ParamSpec]:
    """Parameter names and shapes from a checkpoint's safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir}")
    manifest: dict[str, ParamSpec] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                manifest[name] = ParamSpec(tuple(sl.get_shape()), sl.get_dtype())
    return manifest


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def validate_update(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, ParamSpec],
                    check_finite: bool = True) -> None:
    """Refuse an update that would not replace every parameter cleanly. ``check_finite=False`` leaves the
    NaN/inf check to the caller (who can do it in one pass over a packed buffer)."""
    missing = sorted(set(manifest) - set(tensors))
    unknown = sorted(set(tensors) - set(manifest))
    if missing or unknown:
        raise WeightUpdateError(
            f"update does not match the engine's parameters: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}"
        )
    for name, tensor in tensors.items():
        want = manifest[name]
        if tuple(tensor.shape) != want.shape:
            raise WeightUpdateError(f"parameter {name}: shape {tuple(tensor.shape)}, engine expects {want.shape}")
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"parameter {name}: dtype {tensor.dtype} is not floating point")
    if check_finite and (bad := first_non_finite(tensors)) is not None:
        raise WeightUpdateError(f"parameter {bad}: contains NaN or infinite values")


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding NaN or inf, if any."""
    return next((name for name, t in tensors.items() if not bool(torch.isfinite(t).all())), None)


def staging_root() -> Path:
    """Prefer shared memory so a reload reads from RAM, not disk."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def stage(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, root: Path | None = None) -> Path:
    """Write the tensors as one safetensors file in a fresh directory, complete before it is visible."""
    from safetensors.torch import save_file

    root = root or staging_root()
    tmp = Path(tempfile.mkdtemp(prefix=".asyncrl-staging-", dir=root))
    try:
        payload = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
        save_file(payload, str(tmp / WEIGHTS_FILE))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


async def validate_and_stage(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, ParamSpec],
                             dtype: torch.dtype, root: Path | None = None) -> Path:
    """``validate_update``, then ``stage`` in a thread. If the caller is cancelled while the file is being
    written, the directory is removed once the write is done.

    Validation runs on the caller's thread (an ``isfinite`` pass, ~1.2 s per GiB). An earlier attempt to move
    it into the thread was reverted over "exit status 255" failures that later turned out to be the test's
    own race (psutil reaping the child before asyncio), not this code."""
    validate_update(tensors, manifest)
    job = asyncio.ensure_future(asyncio.to_thread(stage, tensors, dtype, root))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(_remove_staged)
        raise


def _remove_staged(done: asyncio.Future[Path]) -> None:
    if not done.cancelled() and done.exception() is None:
        shutil.rmtree(done.result(), ignore_errors=True)


def state_dict_for_engine(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint-format tensors of a transformers model, without tied duplicates."""
    tensors = dict(model.state_dict())
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def torch_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[name]
