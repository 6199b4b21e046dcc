"""The in-process engine's side of LoRA publication (``lora.transport``): vLLM's ``add_lora`` / ``remove_lora`` /
``list_loras``, and the ``LoRARequest`` each request names (vLLM imported where a request is made)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.engines.lora.transport import AdapterPort, ServedAdapter


def lora_request(adapter: ServedAdapter | None) -> Any:
    """vLLM's request for ``adapter`` (None: the base model). vLLM tells adapters apart by name."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=str(adapter.path))


class LocalAdapterPort(AdapterPort):
    """Adapters registered with an ``AsyncLLM``; ``call`` races each call against the engine's death."""

    def __init__(self, llm: Callable[[], Any], call: Callable[[Any], Awaitable[Any]]) -> None:
        self._llm = llm  # the engine's current AsyncLLM (a closed engine swaps in a stand-in)
        self._call = call

    async def add(self, adapter: ServedAdapter) -> None:
        if not await self._call(self._llm().add_lora(lora_request(adapter))):
            raise RuntimeError(f"vLLM refused adapter {adapter.name} from {adapter.path}")

    async def remove(self, adapter: ServedAdapter) -> None:
        await self._call(self._llm().remove_lora(adapter.lora_id))

    async def holds(self, adapter: ServedAdapter) -> bool:
        return adapter.lora_id in await self._call(self._llm().list_loras())
