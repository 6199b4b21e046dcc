"""The in-process engine's side of LoRA publication (``transports.adapters``): vLLM's ``add_lora`` /
``remove_lora`` / ``list_loras``, the ``LoRARequest`` each request names, and the engine's base as a sampler of
its own (requests that name no adapter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.engines.transports.adapters import AdapterPort, ServedAdapter
from asyncrl.types import Sample

if TYPE_CHECKING:
    from asyncrl.engines.vllm_local.engine import VLLMEngine


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


class BaseSampler:
    """The frozen base under a LoRA engine's adapters, as a ``Sampler``: the same engine, requests without an
    adapter, version 0 throughout. Its requests pause and resume with the engine's publications."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.name = f"{engine.name}/base"

    @property
    def version(self) -> int:
        return 0

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def behaviour_precision(self) -> BehaviourPrecision:
        return self._engine.behaviour_precision

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        return await self._engine.generate(prompt_ids, params, request_id, n, base=True)
