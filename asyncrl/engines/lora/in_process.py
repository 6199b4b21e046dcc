"""The in-process engine's side of LoRA publication (``lora.transport``): adapters registered from memory through
the workers (``worker_ext.AsyncRLWorkerExtension.asyncrl_add_adapter``), removed and listed through vLLM's
``remove_lora`` / ``list_loras``, and the ``LoRARequest`` each request names (vLLM imported where one is made)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.engines.lora.transport import AdapterContents, AdapterPort, ServedAdapter

Rpc = Callable[..., Awaitable[Any]]  # rpc(method, *args): a collective call on the engine's workers


def memory_path(adapter: ServedAdapter) -> str:
    """The path a request names for ``adapter`` (vLLM requires one). No such file exists: should vLLM ever try to
    reload the adapter from it, the request fails loudly instead of running on another adapter."""
    return f"asyncrl-memory/{adapter.name}"


def lora_request(adapter: ServedAdapter | None) -> Any:
    """vLLM's request for ``adapter`` (None: the base model). vLLM tells adapters apart by name."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=memory_path(adapter))


class LocalAdapterPort(AdapterPort):
    """Adapters registered with an ``AsyncLLM``'s workers from memory; ``call`` races each call against the
    engine's death."""

    def __init__(self, llm: Callable[[], Any], call: Callable[[Any], Awaitable[Any]], rpc: Rpc) -> None:
        self._llm = llm  # the engine's current AsyncLLM (a closed engine swaps in a stand-in)
        self._call = call
        self._rpc = rpc

    async def add(self, adapter: ServedAdapter, contents: AdapterContents) -> None:
        data = await asyncio.to_thread(contents.serialise)
        taken = await self._rpc("asyncrl_add_adapter", adapter.name, adapter.lora_id, memory_path(adapter),
                                contents.settings, data)
        if not all(taken):
            raise RuntimeError(f"vLLM's workers refused adapter {adapter.name}")

    async def remove(self, adapter: ServedAdapter) -> None:
        await self._call(self._llm().remove_lora(adapter.lora_id))

    async def holds(self, adapter: ServedAdapter) -> bool:
        return adapter.lora_id in await self._call(self._llm().list_loras())

    async def close(self) -> None:
        pass  # nothing outside the engine: its adapters go with it
