"""NCCL broadcast to a GPU server: vLLM's NCCL weight-transfer backend as a ``RemoteVLLMEngine``'s transport
(``RemoteEngineConfig.nccl``).

The server runs with ``--weight-transfer-config '{"backend": "nccl"}'``; this process joins the transfer group as
rank 0 and broadcasts every tensor from its own GPU, which must not be one the server uses (NCCL does not put
two ranks on one device). The server's workers (ranks 1..) load them with the layerwise-reload path.

The names, dtypes and shapes are announced first (from the file headers for staged files, so no data is read
for them); then each tensor is read, moved to the GPU and broadcast in turn, so the sender never holds more than
one tensor of the update that was not on its GPU already. Only the payload fields common to vLLM 0.26 and 0.32
are sent: one broadcast per tensor.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from asyncrl.aio import together
from asyncrl.engines.transports.base import FULL_ONLY, Transport
from asyncrl.engines.updates import WeightUpdate
from asyncrl.engines.vllm_remote.api import ServerApi
from asyncrl.engines.vllm_remote.config import NcclTransportConfig
from asyncrl.engines.weights import ParamSpec, check_specs, torch_dtype, validate_update
from asyncrl.errors import EngineError, WeightUpdateError

__all__ = ["NcclTransport", "NcclTransportConfig"]

log = logging.getLogger(__name__)


class NcclTransport(Transport):
    """Check before the pause; broadcast under it through the server's four-phase weight-update endpoints."""

    kind = "nccl"
    accepts = FULL_ONLY

    def __init__(self, engine: str, api: ServerApi, cfg: NcclTransportConfig,
                 manifest: Mapping[str, ParamSpec]) -> None:
        self._engine = engine
        self._api = api
        self._cfg = cfg
        self._manifest = manifest
        self._group: Any = None  # vLLM PyNcclCommunicator

    async def open(self) -> None:
        """Form the transfer group with the server's workers."""
        workers = int((await self._api.get("/get_world_size"))["world_size"])
        rendezvous = {"master_address": self._cfg.master_address, "master_port": self._cfg.master_port,
                      "world_size": workers + 1}
        init_info = {**rendezvous, "rank_offset": 1}  # the workers take the ranks after ours
        # The workers block inside init_weight_transfer_engine until rank 0 (us) joins: run both at once.
        async with asyncio.timeout(self._cfg.init_timeout_s):
            _, self._group = await together(
                self._api.post("/init_weight_transfer_engine", body={"init_info": init_info}, timeout_s=math.inf),
                asyncio.to_thread(self._join, rendezvous))
        log.info("NCCL weight-transfer group with %s ready (%d workers)", self._api.base_url, workers)

    def _join(self, rendezvous: dict[str, Any]) -> Any:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self._cfg.device)  # trainer_init opens the group on the current device
        return trainer_init(rendezvous)

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        """Checks only: the tensors travel under the pause."""
        specs = update.source.file_specs
        if specs is not None:
            check_specs(specs, self._manifest)
        else:
            await asyncio.to_thread(validate_update, update.tensors, self._manifest)
        return replace(update, staged=update.version)

    async def load(self, update: WeightUpdate) -> None:
        if self._group is None:
            raise WeightUpdateError("NCCL weight transport is not set up")
        if update.staged != update.version:
            raise WeightUpdateError(f"engine {self._engine}: version {update.version} was not prepared")
        tensors, specs = update.tensors, update.source.file_specs
        names = list(tensors)
        try:
            await self._api.post("/start_weight_update")
            # /update_weights returns once the workers have received (and loaded) every broadcast tensor.
            info = {"names": names, **_layout(tensors, names, specs)}
            await together(
                self._api.post("/update_weights", body={"update_info": info}, timeout_s=math.inf),
                asyncio.to_thread(self._broadcast, tensors, names))
            await self._api.post("/finish_weight_update", body={"weight_version": str(update.version)})
        except (EngineError, WeightUpdateError):
            raise
        except Exception as exc:
            raise EngineError(self._engine, f"weight transfer failed ({exc!r}); the server's weights are "
                                            f"undefined") from exc

    def _broadcast(self, tensors: Mapping[str, Any], names: list[str]) -> None:
        import torch

        torch.cuda.set_device(self._cfg.device)
        stream = torch.cuda.current_stream()
        for name in names:
            source = tensors[name]
            # NCCL sends numel elements from data_ptr(): the tensor must be contiguous and on our device.
            tensor = source.detach().to(self._cfg.device).contiguous()
            self._group.broadcast(tensor, src=0, stream=stream)
            if tensor.data_ptr() != source.data_ptr():
                stream.synchronize()  # a copy made here: the broadcast must be done with it before it is freed
        stream.synchronize()

    async def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "destroy"):
            await asyncio.to_thread(group.destroy)


def _layout(tensors: Mapping[str, Any], names: list[str], specs: Mapping[str, ParamSpec] | None
            ) -> dict[str, list[Any]]:
    """Dtype names and shapes, from the staged files' headers where there are some (no tensor read)."""
    if specs is not None:
        return {"dtype_names": [str(torch_dtype(specs[n].dtype)).removeprefix("torch.") for n in names],
                "shapes": [list(specs[n].shape) for n in names]}
    return {"dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(tensors[n].shape) for n in names]}
