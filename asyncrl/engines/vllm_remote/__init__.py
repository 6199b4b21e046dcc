"""vLLM OpenAI servers over HTTP: the engine, its HTTP API client, the NCCL weight transport, and a launcher
for server processes (``start_vllm_server``: a server that dies with the process that started it)."""

from asyncrl.engines.vllm_remote.config import NcclTransportConfig, RemoteEngineConfig
from asyncrl.engines.vllm_remote.engine import RemoteVLLMEngine
from asyncrl.engines.vllm_remote.process import ServerProcess, free_port, server_precision_args, start_vllm_server

__all__ = ["NcclTransportConfig", "RemoteEngineConfig", "RemoteVLLMEngine", "ServerProcess", "free_port",
           "server_precision_args", "start_vllm_server"]
