"""vLLM's NCCL weight-transfer backend as a ``WeightTransport`` for ``RemoteVLLMEngine`` (GPU servers).

The server runs with ``--weight-transfer-config '{"backend": "nccl"}'``; this process joins the transfer group
as rank 0 and broadcasts every tensor from its own GPU, which must not be one the server uses (NCCL does not
put two ranks on one device).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Annotated, Any

from pydantic import Field

from asyncrl.aio import together
from asyncrl.config_base import Seconds, config
from asyncrl.engines.protocols import WeightUpdate
from asyncrl.engines.vllm_remote.api import ServerApi
from asyncrl.errors import WeightUpdateError

log = logging.getLogger(__name__)


@config
class NcclTransportConfig:
    """Where the trainer side of vLLM's NCCL weight-transfer group lives."""

    master_port: Annotated[int, Field(strict=True, gt=0, lt=65536, description=(
        "free TCP port for the group's rendezvous store, hosted by this (trainer) process"))]
    master_address: Annotated[str, Field(min_length=1, description=(
        "this host, as the server's workers reach it"))] = "127.0.0.1"
    device: Annotated[str, Field(pattern=r"^cuda", description=(
        "the trainer's GPU, from which weights are broadcast (not one the server uses)"))] = "cuda:0"
    init_timeout_s: Annotated[Seconds, Field(description=(
        "group set-up (the workers join it inside /init_weight_transfer_engine)"))] = 300.0


class NcclWeightTransport:
    """Publishes weights through the four-phase endpoints and vLLM's NCCL weight-transfer backend.

    The server must run on GPU with ``--weight-transfer-config '{"backend": "nccl"}'``. This process joins the
    group as rank 0 and broadcasts every tensor; the server's workers (ranks 1..) load them with the
    layerwise-reload path. Only the payload fields common to vLLM 0.26 and 0.32 are sent, so transfers are
    unpacked (one broadcast per tensor; both versions' workers default to that).
    """

    def __init__(self, cfg: NcclTransportConfig) -> None:
        self._cfg = cfg
        self._group: Any = None  # vLLM PyNcclCommunicator

    async def setup(self, api: ServerApi) -> None:
        workers = int((await api.get("/get_world_size"))["world_size"])
        rendezvous = {"master_address": self._cfg.master_address, "master_port": self._cfg.master_port,
                      "world_size": workers + 1}
        init_info = {**rendezvous, "rank_offset": 1}  # the workers take the ranks after ours
        # The workers block inside init_weight_transfer_engine until rank 0 (us) joins: run both at once.
        async with asyncio.timeout(self._cfg.init_timeout_s):
            _, self._group = await together(
                api.post("/init_weight_transfer_engine", body={"init_info": init_info}, timeout_s=math.inf),
                asyncio.to_thread(self._join, rendezvous))
        log.info("NCCL weight-transfer group with %s ready (%d workers)", api.base_url, workers)

    def _join(self, rendezvous: dict[str, Any]) -> Any:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self._cfg.device)  # trainer_init opens the group on the current device
        return trainer_init(rendezvous)

    async def send(self, api: ServerApi, update: WeightUpdate) -> None:
        if self._group is None:
            raise WeightUpdateError("NCCL weight transport is not set up")
        names = list(update.tensors)
        tensors = [update.tensors[n] for n in names]
        info = {"names": names, "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        await api.post("/start_weight_update")
        # /update_weights returns once the workers have received (and loaded) every broadcast tensor.
        await together(api.post("/update_weights", body={"update_info": info}, timeout_s=math.inf),
                        asyncio.to_thread(self._broadcast, tensors))
        await api.post("/finish_weight_update", body={"weight_version": str(update.version)})

    def _broadcast(self, tensors: list[Any]) -> None:
        import torch

        torch.cuda.set_device(self._cfg.device)
        stream = torch.cuda.current_stream()
        for tensor in tensors:
            # NCCL sends numel elements from data_ptr(): the tensor must be contiguous and on our device.
            self._group.broadcast(tensor.detach().to(self._cfg.device).contiguous(), src=0, stream=stream)
        stream.synchronize()

    async def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "destroy"):
            await asyncio.to_thread(group.destroy)
