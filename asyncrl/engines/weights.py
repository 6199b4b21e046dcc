"""Checks and staging for weight updates, shared by every engine that loads weights from files.

An update is validated against the engine's parameter manifest *before* anything reaches the engine, so a bad
update (missing or unknown names, wrong shapes, NaN) is refused with nothing half-applied. Validation and
writing run in a worker thread (an ``isfinite`` pass costs ~1.2 s per GiB): the event loop keeps serving.

Staged updates are safetensors directories named ``.asyncrl-staging-<pid>-*`` under ``/dev/shm`` (or the temp
dir). A ``StagedWeights`` handle counts its holders (the update being published, every engine that loaded it as
its good weights) and removes the directory when the last lets go, so N engines of a pool share one copy.
Directories of a process that died without cleaning up (``kill -9``) are collected by the next process that
stages into the same root.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.aio import TaskOwner
from asyncrl.engines.owned_dirs import collect_dead_owners, make_owned_dir
from asyncrl.errors import WeightUpdateError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
STAGING_PREFIX = ".asyncrl-staging-"


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


def manifest_dtype(manifest: Mapping[str, ParamSpec]) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (what a staged update is written as)."""
    return torch_dtype(next(iter(manifest.values())).dtype)


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


def all_finite(flat: torch.Tensor, chunk: int = 1 << 28) -> bool:
    """Whether ``flat`` holds no NaN or inf, checked in chunks: a mask of the whole costs a byte an element (7 GiB
    for a 7B snapshot, enough to fail beside an engine on 80 GiB)."""
    return bool(torch.stack([torch.isfinite(part).all() for part in flat.split(chunk)]).all())


def staging_root() -> Path:
    """Prefer shared memory so a reload reads from RAM, not disk."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class StagedWeights:
    """A staged weights directory with a count of its holders; removed when the last one releases it.

    ``owned=False`` wraps a directory asyncrl did not write (the model's own checkpoint): never removed."""

    def __init__(self, path: Path, *, owned: bool = True) -> None:
        self.path = path
        self.owned = owned
        self._holders = 1  # the creator
        self._lock = threading.Lock()  # released from worker threads too (a cancelled stage)

    def acquire(self) -> StagedWeights:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError(f"staged weights {self.path} were already removed")
            self._holders += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            gone = self._holders == 0
        if gone and self.owned:
            shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return f"StagedWeights({str(self.path)!r}, holders={self._holders})"


def stage(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, root: Path | None = None) -> StagedWeights:
    """Write the tensors as one safetensors file in a fresh directory, complete before it is visible."""
    from safetensors.torch import save_file

    tmp = make_staging_dir(root)
    try:
        payload = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
        save_file(payload, str(tmp / WEIGHTS_FILE))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StagedWeights(tmp)


def make_staging_dir(root: Path | None = None) -> Path:
    """A new staging directory of this process under ``root`` (default ``staging_root()``), after collecting
    those of dead processes there (``owned_dirs``)."""
    return make_owned_dir(root or staging_root(), STAGING_PREFIX)


def collect_stale_staging(root: Path) -> list[Path]:
    """Remove staging directories under ``root`` whose writing process is gone. Returns what was removed."""
    return collect_dead_owners(root, STAGING_PREFIX)


class StageAbandoned(Exception):
    """The caller was cancelled before the write began: nothing was written."""


def _validate_and_stage(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, ParamSpec],
                        dtype: torch.dtype, root: Path | None, abandon: threading.Event) -> StagedWeights:
    validate_update(tensors, manifest)
    if abandon.is_set():
        raise StageAbandoned
    return stage(tensors, dtype, root)


async def validate_and_stage(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, ParamSpec],
                             dtype: torch.dtype, root: Path | None = None) -> StagedWeights:
    """``validate_update`` and ``stage``, both in a worker thread. Raises ``WeightUpdateError`` for a bad
    update. A cancelled caller skips the write if it has not begun, else waits for it and removes the directory
    before the cancellation comes through, so no staging directory outlives a cancelled call (the delay is at
    most the rest of one validation or write)."""
    return await stage_in_thread(lambda abandon: _validate_and_stage(tensors, manifest, dtype, root, abandon))


async def stage_in_thread(write: Callable[[threading.Event], StagedWeights]) -> StagedWeights:
    """``write(abandon)`` in a worker thread; it should check ``abandon`` before it starts writing. A cancelled
    caller sets it, waits for a write under way and removes what it wrote, so nothing outlives the call."""
    abandon = threading.Event()
    async with TaskOwner("stage-weights") as owner:  # awaited to its end on every path: the owner is a backstop
        job = owner.start(asyncio.to_thread(write, abandon))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            abandon.set()
            await _release_when_done(job)
            raise


async def _release_when_done(job: asyncio.Future[StagedWeights]) -> None:
    """Wait for the worker thread (a thread cannot be interrupted) and drop what it wrote."""
    while not job.done():
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            continue  # cancelled again: the cleanup still has to finish
        except BaseException:
            break
    if not job.cancelled() and job.exception() is None:
        job.result().release()


def state_dict_for_engine(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint-format tensors of a transformers model, without tied duplicates."""
    tensors = dict(model.state_dict())
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def torch_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[name]


class StagedTensors(Mapping[str, torch.Tensor]):
    """A staged directory seen as name -> tensor. Names, shapes and dtypes come from the file headers; a
    tensor is read from its file each time it is asked for (nothing is held in memory)."""

    def __init__(self, staged: StagedWeights) -> None:
        self.staged = staged
        self.specs = read_manifest(staged.path)  # name -> shape and dtype
        self._files = _owners(staged.path)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def release(self) -> None:
        """The creator's hold on the directory; engines that loaded it hold their own."""
        self.staged.release()


def _owners(path: Path) -> dict[str, Path]:
    from safetensors import safe_open

    owners = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            owners.update({name: file for name in f.keys()})
    return owners


def check_specs(specs: Mapping[str, ParamSpec], manifest: Mapping[str, ParamSpec]) -> None:
    """Refuse staged weights that would not replace every parameter of the served model exactly."""
    missing, unknown = sorted(set(manifest) - set(specs)), sorted(set(specs) - set(manifest))
    if missing or unknown:
        raise WeightUpdateError(f"staged weights do not match the engine's parameters: missing {missing[:5]}, "
                                f"unknown {unknown[:5]}")
    for name, spec in specs.items():
        if spec != manifest[name]:
            raise WeightUpdateError(f"parameter {name}: staged as {spec}, the engine holds {manifest[name]}")
