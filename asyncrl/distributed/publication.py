"""Publishing from a sharded learner: full tensors gathered bucket by bucket, staged by rank 0, adopted by the
engines.

``full_buckets`` is a collective: every rank walks the same parameters in the same order and gathers each
one (``DTensor.full_tensor()``), so at most one bucket of full tensors (``bucket_bytes``, or one tensor if it
is larger) exists at a time; the whole model never does. Rank 0 writes each bucket as one safetensors file
of a staging directory (``stage_buckets``) and hands the engines a ``StagedTensors`` mapping of it: tensors
are read back from the files only when a transport asks for them (NCCL broadcasts them one by one), and an
engine that reloads from files adopts the directory as it is (``PrestagedTarget``), so the files are written
once for N servers, before the pause.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from asyncrl.engines.protocols import WeightTarget, WeightUpdate
from asyncrl.engines.weights import (ParamSpec, StagedWeights, first_non_finite, make_staging_dir, read_manifest,
                                     state_dict_for_engine)
from asyncrl.errors import WeightUpdateError
from asyncrl.types import PauseMode

DEFAULT_BUCKET_BYTES = 256 * 2**20


def full_buckets(model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> Iterator[dict[str, torch.Tensor]]:
    """Every rank: the model's checkpoint-format tensors (no tied duplicates), gathered in full, in buckets of
    about ``bucket_bytes``. Every rank must consume the whole iterator: each tensor is a collective."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state_dict_for_engine(model).items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        bucket[name] = full.detach()
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def stage_buckets(buckets: Iterator[Mapping[str, torch.Tensor]], dtype: torch.dtype,
                  root: Path | None = None) -> StagedTensors:
    """Rank 0: write each bucket as ``model-NNNNN.safetensors`` (CPU, ``dtype``) into a fresh staging directory.

    Every bucket is consumed even after a bad one (the other ranks are gathering with us); then a NaN or inf
    raises ``WeightUpdateError`` and the directory is removed."""
    from safetensors.torch import save_file

    tmp = make_staging_dir(root)
    bad: str | None = None
    try:
        for index, bucket in enumerate(buckets):
            bad = bad or first_non_finite(bucket)
            if bad is None:
                payload = {k: v.detach().to("cpu", dtype).contiguous() for k, v in bucket.items()}
                save_file(payload, str(tmp / f"model-{index:05d}.safetensors"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _drain_quietly(buckets)  # a failed write must not leave the other ranks waiting in a gather
        raise
    if bad is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightUpdateError(f"parameter {bad}: contains NaN or infinite values; nothing was published")
    return StagedTensors(StagedWeights(tmp))


def _drain_quietly(buckets: Iterator[object]) -> None:
    try:
        for _ in buckets:
            pass
    except Exception:  # the gather itself failed: the other ranks see that failure too
        pass


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


class PrestagedTarget(WeightTarget):
    """A ``WeightTarget`` in front of an engine or ``EnginePool`` that lets it adopt ``StagedTensors`` (what
    ``FSDPBackend`` publishes) as already staged, after checking names, shapes and dtype against the served
    model's manifest (no tensor data is read). It publishes nothing else: other updates are refused."""

    def __init__(self, target: WeightTarget, model_dir: str | Path) -> None:
        self.target = target
        self.name = target.name
        self.manifest: dict[str, ParamSpec] = read_manifest(model_dir)

    @property
    def version(self) -> int:
        return self.target.version

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        tensors = update.tensors
        if not isinstance(tensors, StagedTensors):  # input validation: this target's one kind of update
            raise WeightUpdateError(f"{self.name}: PrestagedTarget publishes StagedTensors (a sharded learner's "
                                    f"staging), got {type(tensors).__name__}")
        check_specs(tensors.specs, self.manifest)
        return await self.target.prepare(replace(update, staged=tensors.staged))

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self.target.pause(mode, clear_cache)

    async def load(self, update: WeightUpdate) -> None:
        await self.target.load(update)

    async def resume(self) -> None:
        await self.target.resume()

    def release(self, update: WeightUpdate) -> None:
        self.target.release(update)

    @property
    def sleep_level(self) -> int:
        return self.target.sleep_level

    async def sleep(self, level: int | None = None) -> None:
        await self.target.sleep(level)

    async def wake(self) -> None:
        await self.target.wake()


def check_specs(specs: Mapping[str, ParamSpec], manifest: Mapping[str, ParamSpec]) -> None:
    """Refuse staged weights that would not replace every parameter of the served model exactly."""
    missing, unknown = sorted(set(manifest) - set(specs)), sorted(set(specs) - set(manifest))
    if missing or unknown:
        raise WeightUpdateError(f"staged weights do not match the engine's parameters: missing {missing[:5]}, "
                                f"unknown {unknown[:5]}")
    for name, spec in specs.items():
        if spec != manifest[name]:
            raise WeightUpdateError(f"parameter {name}: staged as {spec}, the engine holds {manifest[name]}")
