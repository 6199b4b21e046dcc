"""Publishing from a sharded learner: full tensors gathered bucket by bucket and staged by rank 0.

``full_buckets`` is a collective: every rank walks the same parameters in the same order and gathers each
one (``DTensor.full_tensor()``), so at most one bucket of full tensors (``bucket_bytes``, or one tensor if it
is larger) exists at a time; the whole model never does. Rank 0 writes each bucket as one safetensors file
of a staging directory (``stage_buckets``) and publishes it as a ``ShardedBuckets`` source: an engine that
reloads from files adopts the directory as it is (written once for N servers, before the pause), and one that
needs tensors (NCCL broadcast, CUDA IPC) reads them back from the files one at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from asyncrl.engines.weights import (StagedTensors, StagedWeights, first_non_finite, make_staging_dir,
                                     state_dict_for_engine)
from asyncrl.errors import WeightUpdateError

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
