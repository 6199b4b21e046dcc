"""The learner's side of CUDA IPC publication: one flat snapshot buffer, handed to the workers by handle.

The workers (``worker_ext.AsyncRLWorkerExtension.asyncrl_stage_ipc``) load it into shadow parameters while
generation still runs; under the pause only ``asyncrl_commit`` copies shadows into the live parameters.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from asyncrl.engines.protocols import StagedInEngine, WeightUpdate
from asyncrl.engines.weights import ParamSpec, first_non_finite, validate_update
from asyncrl.errors import EngineError, WeightUpdateError


def pack_for_ipc(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> tuple[
        torch.Tensor, bytes]:
    """Copy ``tensors`` into one new flat buffer on ``device`` and describe it for ``asyncrl_stage_ipc``.

    The buffer is a snapshot (the learner may keep training) and must stay alive until the worker has
    staged it. Returns ``(buffer, payload)``.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    total = sum(t.numel() for t in tensors.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    layout, offset = [], 0
    for name, tensor in tensors.items():
        n = tensor.numel()
        flat[offset:offset + n].view(tensor.shape).copy_(tensor.detach())
        layout.append((name, tuple(tensor.shape), offset, n))
        offset += n
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    payload = pickle.dumps({"handle": reduce_tensor(flat), "device_uuid": uuid, "layout": layout})
    return flat, payload


async def pack_update(update: WeightUpdate, manifest: Mapping[str, ParamSpec], dtype: torch.dtype) -> tuple[
        torch.Tensor, bytes]:
    """Validate ``update`` and snapshot it into one buffer for the workers (``pack_for_ipc``). The caller frees
    the buffer (``free_snapshot``) once the workers have read it."""
    validate_update(update.tensors, manifest, check_finite=False)
    first = next(iter(update.tensors.values()))
    device = first.device if first.is_cuda else torch.device("cuda", torch.cuda.current_device())
    flat, payload = await asyncio.to_thread(pack_for_ipc, dict(update.tensors), dtype, device)
    if not bool(torch.isfinite(flat).all()):  # one pass over the snapshot instead of one per tensor
        del flat
        free_snapshot()
        raise WeightUpdateError(f"parameter {first_non_finite(update.tensors)}: contains NaN or infinite values")
    return flat, payload


def free_snapshot() -> None:
    """Return a freed snapshot's memory: without ``ipc_collect`` a buffer shared over IPC may stay reserved in
    this process after it is freed."""
    torch.cuda.ipc_collect()


async def stage_in_engine(engine: str, call: Callable[[Any], Awaitable[Any]], llm: Any, update: WeightUpdate,
                          manifest: Mapping[str, ParamSpec], dtype: torch.dtype) -> StagedInEngine:
    """Validate, snapshot into one buffer, and have the workers load it into their shadows."""
    flat, payload = await pack_update(update, manifest, dtype)
    try:
        await call(llm.collective_rpc("asyncrl_stage_ipc", args=(payload, update.version)))
    except (EngineError, WeightUpdateError, asyncio.CancelledError):
        raise
    except Exception as exc:  # e.g. a name vLLM's loader does not know: only the shadows were touched
        raise WeightUpdateError(f"engine {engine}: staging the update failed ({exc!r}); live weights "
                                f"untouched") from exc
    finally:
        del flat  # the workers copied it (or failed) and dropped their handles
        free_snapshot()
    return StagedInEngine(update.version)
