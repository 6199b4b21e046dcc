"""A vLLM server's side of LoRA publication (``engines.lora.transport``): its run-time adapter endpoints.

The server runs with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its
environment (``lora_server_args`` gives both, for ``start_vllm_server``). An adapter is served under its name: a
request names it as its ``model``. The server's API registers a name only with ``/v1/load_lora_adapter``, which
reads a PEFT directory, so the port writes each adapter into one in shared memory (the staging root, as full
weights are staged for a server: nothing reaches a disk) and deletes it once the adapter is removed.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Protocol

from asyncrl.engines.lora.transport import AdapterContents, AdapterPort, LoraServingConfig, ServedAdapter
from asyncrl.engines.weights import StageAbandoned, StagedWeights, make_staging_dir, stage_in_thread

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def lora_server_args(serving: LoraServingConfig) -> tuple[list[str], dict[str, str]]:
    """The command-line flags and environment a server needs to take adapters at run time."""
    args = ["--enable-lora", "--max-lora-rank", str(serving.max_rank), "--max-loras", str(serving.max_loras),
            "--max-cpu-loras", str(serving.max_cpu_loras)]
    return args, {RUNTIME_LORA_ENV: "True"}


class JsonApi(Protocol):
    """What the port needs of a server's API: JSON in, JSON out, errors raised."""

    async def post(self, path: str, *, body: Any = None) -> Any: ...

    async def get(self, path: str) -> Any: ...


def write_adapter_dir(contents: AdapterContents, root: Path | None) -> StagedWeights:
    """A PEFT adapter directory holding ``contents``, under ``root`` (default: the staging root)."""
    from safetensors.torch import save_file

    tmp = make_staging_dir(root)
    try:
        save_file(dict(contents.tensors), str(tmp / ADAPTER_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(contents.settings))
    except BaseException:
        StagedWeights(tmp).release()
        raise
    return StagedWeights(tmp)


class RemoteAdapterPort(AdapterPort):
    """Adapters loaded into a vLLM server at run time, each from a directory the port keeps while it is served."""

    def __init__(self, api: JsonApi, root: Path | None = None) -> None:
        self._api = api
        self._root = root
        self._dirs: dict[ServedAdapter, StagedWeights] = {}

    async def add(self, adapter: ServedAdapter, contents: AdapterContents) -> None:
        def write(abandon: threading.Event) -> StagedWeights:
            if abandon.is_set():
                raise StageAbandoned
            return write_adapter_dir(contents, self._root)

        staged = await stage_in_thread(write)  # a cancelled call leaves no directory behind
        self._dirs[adapter] = staged  # kept until removed, even if the call below fails or is cancelled
        await self._api.post("/v1/load_lora_adapter", body={"lora_name": adapter.name, "lora_path": str(staged.path)})

    async def remove(self, adapter: ServedAdapter) -> None:
        try:
            await self._api.post("/v1/unload_lora_adapter", body={"lora_name": adapter.name})
        finally:
            if (staged := self._dirs.pop(adapter, None)) is not None:
                staged.release()

    async def holds(self, adapter: ServedAdapter) -> bool:
        models = await self._api.get("/v1/models")
        return any(model.get("id") == adapter.name for model in models.get("data", ()))

    async def close(self) -> None:
        for staged in self._dirs.values():
            staged.release()
        self._dirs.clear()
