"""vLLM's ``AsyncLLM`` in this process: the engine, its config, and the code that runs inside vLLM's own
processes (the worker extension and the napping executor). Importing it refuses torch companion packages that
cannot load beside this torch (``companions``)."""

from asyncrl.engines.vllm_local.companions import check_torch_companions

check_torch_companions()  # before vLLM and transformers fail on them, far from the cause

from asyncrl.engines.vllm_local.config import VLLMEngineConfig, WeightTransfer
from asyncrl.engines.vllm_local.engine import VLLMEngine

__all__ = ["VLLMEngine", "VLLMEngineConfig", "WeightTransfer"]
