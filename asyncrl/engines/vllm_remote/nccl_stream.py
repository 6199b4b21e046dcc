"""vLLM's NCCL weight transfer, fed one tensor at a time: for updates too large to hold at once on the sending
side (a sharded learner's staged buckets, read back tensor by tensor).

``NcclWeightTransport.send`` lists every tensor before broadcasting; this one announces the names, dtypes and
shapes from the update's metadata (``StagedTensors.specs`` when there is one, so no data is read for it) and
then reads, moves to the GPU and broadcasts each tensor in turn, so the sender holds one tensor at a time.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from asyncrl.aio import together
from asyncrl.engines.protocols import WeightUpdate
from asyncrl.engines.vllm_remote.api import ServerApi
from asyncrl.engines.vllm_remote.nccl import NcclWeightTransport
from asyncrl.engines.weights import torch_dtype
from asyncrl.errors import WeightUpdateError



class StreamingNcclTransport(NcclWeightTransport):
    """``NcclWeightTransport`` that never holds more than one tensor of the update on the sending side."""

    async def send(self, api: ServerApi, update: WeightUpdate) -> None:
        if self._group is None:
            raise WeightUpdateError("NCCL weight transport is not set up")
        names = list(update.tensors)
        info = {"names": names, **_layout(update.tensors, names)}
        await api.post("/start_weight_update")
        await together(api.post("/update_weights", body={"update_info": info}, timeout_s=math.inf),
                       asyncio.to_thread(self._stream, update.tensors, names))
        await api.post("/finish_weight_update", body={"weight_version": str(update.version)})

    def _stream(self, tensors: Mapping[str, Any], names: list[str]) -> None:
        import torch

        torch.cuda.set_device(self._cfg.device)
        stream = torch.cuda.current_stream()
        for name in names:
            tensor = tensors[name].detach().to(self._cfg.device).contiguous()
            self._group.broadcast(tensor, src=0, stream=stream)
            stream.synchronize()  # the buffer is freed at the next iteration: the broadcast must be done with it


def _layout(tensors: Mapping[str, Any], names: list[str]) -> dict[str, list[Any]]:
    """Dtype names and shapes, from the update's specs where it has them (no tensor read)."""
    specs = getattr(tensors, "specs", None)
    if specs is not None:
        return {"dtype_names": [str(torch_dtype(specs[n].dtype)).removeprefix("torch.") for n in names],
                "shapes": [list(specs[n].shape) for n in names]}
    return {"dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(tensors[n].shape) for n in names]}
