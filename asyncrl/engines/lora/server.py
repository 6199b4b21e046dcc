"""A vLLM server's side of LoRA publication (``engines.lora.transport``): its run-time adapter endpoints.

The server runs with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its
environment (``lora_server_args`` gives both, for ``start_vllm_server``). An adapter is served under its name: a request
names it as its ``model``.
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncrl.engines.lora.transport import AdapterPort, LoraServingConfig, ServedAdapter

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_server_args(serving: LoraServingConfig) -> tuple[list[str], dict[str, str]]:
    """The command-line flags and environment a server needs to take adapters at run time."""
    args = ["--enable-lora", "--max-lora-rank", str(serving.max_rank), "--max-loras", str(serving.max_loras),
            "--max-cpu-loras", str(serving.max_cpu_loras)]
    return args, {RUNTIME_LORA_ENV: "True"}


class JsonApi(Protocol):
    """What the port needs of a server's API: JSON in, JSON out, errors raised."""

    async def post(self, path: str, *, body: Any = None) -> Any: ...

    async def get(self, path: str) -> Any: ...


class RemoteAdapterPort(AdapterPort):
    """Adapters loaded into a vLLM server at run time."""

    def __init__(self, api: JsonApi) -> None:
        self._api = api

    async def add(self, adapter: ServedAdapter) -> None:
        await self._api.post("/v1/load_lora_adapter", body={"lora_name": adapter.name, "lora_path": str(adapter.path)})

    async def remove(self, adapter: ServedAdapter) -> None:
        await self._api.post("/v1/unload_lora_adapter", body={"lora_name": adapter.name})

    async def holds(self, adapter: ServedAdapter) -> bool:
        models = await self._api.get("/v1/models")
        return any(model.get("id") == adapter.name for model in models.get("data", ()))
