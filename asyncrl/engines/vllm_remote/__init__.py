"""vLLM OpenAI servers over HTTP: the engine, its HTTP API client, the NCCL weight transport, and a launcher
for server processes."""

from asyncrl.engines.vllm_remote.config import RemoteEngineConfig
from asyncrl.engines.vllm_remote.engine import RemoteVLLMEngine, WeightTransport

__all__ = ["RemoteEngineConfig", "RemoteVLLMEngine", "WeightTransport"]
