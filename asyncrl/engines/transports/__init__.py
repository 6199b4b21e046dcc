"""The one seam weights cross into an engine (``base.WeightTransport``: stage, load, release) and the transports
every kind of engine can use: staged files (``files``). LoRA adapters have a package of their own
(``asyncrl.engines.lora``). The transports tied to one engine live with it: CUDA IPC into shadow parameters and
sleep/wake (``vllm_local``), NCCL broadcast to servers (``vllm_remote.nccl``)."""

from asyncrl.engines.transports.base import Transport, WeightTransport

__all__ = ["Transport", "WeightTransport"]
