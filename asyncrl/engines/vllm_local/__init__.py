"""vLLM's ``AsyncLLM`` in this process: the engine, its config, and the code that runs inside vLLM's own
processes (the worker extension and the napping executor)."""

from asyncrl.engines.vllm_local.config import VLLMEngineConfig, WeightTransfer
from asyncrl.engines.vllm_local.engine import VLLMEngine

__all__ = ["VLLMEngine", "VLLMEngineConfig", "WeightTransfer"]
