"""CUDA IPC into shadow parameters: the transport of an in-process engine on GPU (``weight_transfer=cuda_ipc``).

``stage`` snapshots the update into one flat buffer on the learner's GPU and hands its IPC handle to the
workers (``worker_ext.AsyncRLWorkerExtension.asyncrl_stage_ipc``), which load it into shadow parameters while
generation still runs; under the pause ``load`` only has the workers copy the shadows into the live parameters
(``asyncrl_commit``), one device copy. The shadows stay allocated: the next stage overwrites them.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from asyncrl.engines.transports.base import FULL_ONLY, Transport
from asyncrl.engines.updates import StagedInEngine, WeightUpdate
from asyncrl.engines.vllm_local.worker_ext import device_uuid
from asyncrl.engines.weights import ParamSpec, all_finite, check_specs, first_non_finite, validate_update
from asyncrl.errors import EngineError, WeightUpdateError

Rpc = Callable[..., Awaitable[Any]]  # rpc(method, *args): a collective call on the engine's workers


def pack_for_ipc(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 specs: Mapping[str, ParamSpec] | None = None) -> tuple[torch.Tensor, bytes]:
    """Copy ``tensors`` into one new flat buffer on ``device`` and describe it for ``asyncrl_stage_ipc``.

    The buffer is a snapshot (the learner may keep training) and must stay alive until the worker has
    staged it. ``specs``: the shapes of staged files, from their headers (each tensor is then read once).
    Returns ``(buffer, payload)``.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    shapes = {name: specs[name].shape if specs is not None else tuple(tensors[name].shape) for name in tensors}
    total = sum(int(torch.Size(s).numel()) for s in shapes.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    layout, offset = [], 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        flat[offset:offset + n].view(shape).copy_(tensors[name].detach())
        layout.append((name, shape, offset, n))
        offset += n
    payload = pickle.dumps({"handle": reduce_tensor(flat), "device_uuid": device_uuid(device), "layout": layout})
    return flat, payload


async def pack_update(update: WeightUpdate, manifest: Mapping[str, ParamSpec], dtype: torch.dtype) -> tuple[
        torch.Tensor, bytes]:
    """Validate ``update`` (full weights) and snapshot it into one buffer for the workers (``pack_for_ipc``). The
    caller frees the buffer (``free_snapshot``) once the workers have read it."""
    tensors = update.tensors
    specs = update.source.file_specs  # files staged already (a pool member's, a sharded learner's)
    if specs is not None:
        check_specs(specs, manifest)
    else:
        validate_update(tensors, manifest, check_finite=False)
    first = next(iter(tensors.values())) if specs is None else None
    device = first.device if first is not None and first.is_cuda else torch.device("cuda", torch.cuda.current_device())
    flat, payload = await asyncio.to_thread(pack_for_ipc, tensors, dtype, device, specs)
    if not all_finite(flat):  # one pass over the snapshot instead of one per tensor
        del flat
        free_snapshot()
        raise WeightUpdateError(f"parameter {first_non_finite(tensors)}: contains NaN or infinite values")
    return flat, payload


def free_snapshot() -> None:
    """Return a freed snapshot's memory: without ``ipc_collect`` a buffer shared over IPC may stay reserved in
    this process after it is freed."""
    torch.cuda.ipc_collect()


class CudaIpcTransport(Transport):
    """Stage into the workers' shadow parameters over CUDA IPC; commit them under the pause."""

    kind = "cuda_ipc"
    accepts = FULL_ONLY
    direct_while_asleep = True  # see sleep.SleepTransport

    def __init__(self, engine: str, rpc: Rpc, manifest: Mapping[str, ParamSpec], dtype: torch.dtype) -> None:
        self._engine = engine
        self._rpc = rpc
        self._manifest = manifest
        self._dtype = dtype

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        flat, payload = await pack_update(update, self._manifest, self._dtype)
        try:
            await self._rpc("asyncrl_stage_ipc", payload, update.version)
        except (EngineError, WeightUpdateError, asyncio.CancelledError):
            raise
        except Exception as exc:  # e.g. a name vLLM's loader does not know: only the shadows were touched
            raise WeightUpdateError(f"engine {self._engine}: staging the update failed ({exc!r}); live weights "
                                    f"untouched") from exc
        finally:
            del flat  # the workers copied it (or failed) and dropped their handles
            free_snapshot()
        return replace(update, staged=StagedInEngine(update.version))

    async def load(self, update: WeightUpdate) -> None:
        # The commit checks the staged version before copying anything, so a refusal leaves the live
        # weights as they were; a fault during the device copy kills the engine (EngineError).
        if update.staged != StagedInEngine(update.version):
            raise WeightUpdateError(f"engine {self._engine}: version {update.version} was not prepared")
        try:
            await self._rpc("asyncrl_commit", update.version)
        except EngineError:
            raise
        except Exception as exc:
            raise WeightUpdateError(f"engine {self._engine}: commit of staged weights failed ({exc!r}); the "
                                    f"previous weights stay") from exc

    async def before_sleep(self) -> None:
        """Free the shadows (they live outside vLLM's memory pool: sleeping would not free them)."""
        await self._rpc("asyncrl_release_shadows")

    async def reload_last(self) -> None:
        raise WeightUpdateError(f"engine {self._engine}: sleep level 2 discarded the weights and none were "
                                "loaded since; publish an update to wake it")
