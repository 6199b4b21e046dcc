"""LoRA adapters: publication sends the adapter alone (a few MiB) into an engine that serves the frozen base model
with vLLM's LoRA support, in this process (``VLLMEngineConfig.lora``) or in a server (``RemoteEngineConfig.lora``).

``stage`` checks the adapter against the served base model (every adapted module exists, ``A`` is rank x in and
``B`` out x rank, the rank fits the engine's ``max_rank``, no NaN) and writes it as a PEFT adapter directory in
shared memory, all before the pause. ``load`` registers it under a new name and id per version
(``asyncrl-v{version}``): vLLM fixes a request's adapter when the request is submitted, so with a new adapter per
version every token a request samples comes from one known adapter, and the request's version is that adapter's.
Requests submitted from then on name the new adapter (``checkout``).

Across the pause, by mode:

- ``abort``: requests in flight end at once with the tokens sampled so far, all from the old adapter;
- ``wait``: requests in flight finish on the old adapter before the load; none is in flight across it;
- ``keep``: requests in flight are frozen and, after the resume, go on with the adapter they were submitted with
  (the old one) to their end; their tokens carry the old version, and the staleness filter and the importance
  weights treat them as such.

An old adapter is removed from the engine, and its directory deleted, once no request holds it any more.
A load the engine does not confirm (the new adapter missing from the engine's list afterwards) is refused: the
engine would otherwise go on serving another version.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

import torch
from pydantic import Field

from asyncrl.config_base import PositiveInt, config
from asyncrl.engines.transports.base import Transport
from asyncrl.engines.updates import UpdateKind, WeightSource, WeightUpdate
from asyncrl.engines.weights import (ParamSpec, StagedWeights, first_non_finite, make_staging_dir,
                                     stage_in_thread, StageAbandoned)
from asyncrl.errors import EngineError, WeightUpdateError

if TYPE_CHECKING:
    from asyncrl.lora.config import LoraConfig

__all__ = ["AdapterPort", "AdapterTransport", "LoraServingConfig", "ServedAdapter", "adapter_dir_files"]

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM supports (0.26-0.32)


@config
class LoraServingConfig:
    """What an engine serving LoRA adapters holds (vLLM's ``--enable-lora`` settings)."""

    max_rank: Annotated[Literal[1, 8, 16, 32, 64, 128, 256, 320, 512], Field(description=(
        "the largest adapter rank the engine accepts (vLLM's max_lora_rank, one of the sizes it supports; it "
        "sizes the LoRA buffers)"))] = 16
    max_loras: Annotated[PositiveInt, Field(description=(
        "adapters one batch may mix: 2 lets requests frozen by a keep pause finish on the old adapter while "
        "new ones start on the new one"))] = 2
    max_cpu_loras: Annotated[PositiveInt, Field(description=(
        "adapters the engine keeps loaded (an evicted one is loaded again from its directory when a request "
        "needs it)"))] = 8

    @classmethod
    def holding(cls, rank: int) -> LoraServingConfig:
        """Serving for adapters up to ``rank``: the smallest ``max_rank`` vLLM supports that holds it."""
        fits = [size for size in MAX_RANKS if size >= rank]
        if not fits:
            raise ValueError(f"rank {rank} exceeds vLLM's largest max_lora_rank {MAX_RANKS[-1]}")
        return cls(max_rank=fits[0])  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """One published adapter as the engine knows it."""

    version: int
    name: str  # asyncrl-v{version}: what a request names (vLLM tells adapters apart by name)
    lora_id: int  # vLLM's integer id, > 0
    path: Path  # the PEFT adapter directory


class AdapterPort(Protocol):
    """The engine's side: registering and removing adapters (in-process calls, or a server's endpoints)."""

    async def add(self, adapter: ServedAdapter) -> None:
        ...

    async def remove(self, adapter: ServedAdapter) -> None:
        ...

    async def holds(self, adapter: ServedAdapter) -> bool:
        """Whether the engine has ``adapter`` registered now."""
        ...


class AdapterTransport(Transport):
    """Adapter-only publication; also tells the engine which adapter each new request must name."""

    kind = "lora"
    accepts = frozenset({UpdateKind.ADAPTER})

    def __init__(self, engine: str, port: AdapterPort, manifest: Mapping[str, ParamSpec], serving: LoraServingConfig,
                 dtype: torch.dtype, root: Path | None = None) -> None:
        self._engine = engine
        self._port = port
        self._manifest = manifest
        self._serving = serving
        self._dtype = dtype
        self._root = root
        self._current: ServedAdapter | None = None  # None: the base model, version 0
        self._dirs: dict[ServedAdapter, StagedWeights] = {}  # the directory each registered adapter reads
        self._holders: dict[ServedAdapter, int] = {}  # requests in flight on each adapter
        self._retired: list[ServedAdapter] = []  # replaced, to remove once no request holds them

    @property
    def current(self) -> ServedAdapter | None:
        return self._current

    @contextlib.contextmanager
    def hold(self) -> Iterator[ServedAdapter | None]:
        """The adapter a request submitted now must name (None: the base model), kept registered until the
        request is over."""
        adapter = self._current
        if adapter is not None:
            self._holders[adapter] = self._holders.get(adapter, 0) + 1
        try:
            yield adapter
        finally:
            if adapter is not None:
                self._holders[adapter] -= 1

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        staged = await _check_and_write(update.source, self._manifest, self._serving.max_rank, self._dtype,
                                        self._root)
        return replace(update, staged=staged)

    async def load(self, update: WeightUpdate) -> None:
        if update.staged is None:
            raise WeightUpdateError(f"engine {self._engine}: version {update.version} was not prepared")
        adapter = ServedAdapter(update.version, f"asyncrl-v{update.version}", update.version + 1, update.staged.path)
        try:
            await self._port.add(adapter)
            held = await self._port.holds(adapter)
        except EngineError:
            raise
        except Exception as exc:
            raise WeightUpdateError(f"engine {self._engine}: loading adapter {adapter.name} failed ({exc!r}); "
                                    f"it serves version {self._version_served()} still") from exc
        if not held:
            raise WeightUpdateError(f"engine {self._engine} did not take adapter {adapter.name}; it would go on "
                                    f"serving version {self._version_served()}")
        self._dirs[adapter] = update.staged.acquire()
        if self._current is not None:
            self._retired.append(self._current)
        self._current = adapter
        await self._remove_unheld()

    def release(self, update: WeightUpdate) -> None:
        if update.staged is not None:
            update.staged.release()

    async def close(self) -> None:
        for held in self._dirs.values():
            held.release()
        self._dirs.clear()

    def _version_served(self) -> int:
        return 0 if self._current is None else self._current.version

    async def _remove_unheld(self) -> None:
        """Remove the retired adapters no request holds any more (under the pause: nothing new can hold them)."""
        keep = []
        for adapter in self._retired:
            if self._holders.get(adapter, 0) > 0:
                keep.append(adapter)
                continue
            try:
                await self._port.remove(adapter)
            except EngineError:
                raise
            except Exception as exc:  # it only takes a slot until evicted: not worth failing the publication
                log.warning("engine %s: removing adapter %s failed (%r)", self._engine, adapter.name, exc)
            self._holders.pop(adapter, None)
            self._dirs.pop(adapter).release()
        self._retired = keep


def check_adapter(adapter: WeightSource, manifest: Mapping[str, ParamSpec], max_rank: int) -> LoraConfig:
    """Refuse an adapter the served base model cannot take, naming what is wrong; its shape if it can."""
    cfg = adapter.adapter_config
    if cfg is None:
        raise WeightUpdateError(f"a {adapter.kind.value} update is not a LoRA adapter")
    rank = cfg.rank
    if rank > max_rank:
        raise WeightUpdateError(f"adapter rank {rank} exceeds the engine's max_rank {max_rank} "
                                f"(LoraServingConfig.max_rank)")
    if not adapter.tensors:
        raise WeightUpdateError("the adapter holds no tensors")
    modules: dict[str, set[str]] = {}
    for name, tensor in adapter.tensors.items():
        module, part = _split(name)
        base = manifest.get(f"{module}.weight")
        if base is None or len(base.shape) != 2:
            raise WeightUpdateError(f"adapter tensor {name}: the served model has no linear weight {module}.weight")
        out_features, in_features = base.shape
        want = (rank, in_features) if part == "lora_A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise WeightUpdateError(f"adapter tensor {name}: shape {tuple(tensor.shape)}, expected {want} for rank "
                                    f"{rank} on {module}.weight {base.shape}")
        modules.setdefault(module, set()).add(part)
    lonely = sorted(m for m, parts in modules.items() if parts != {"lora_A", "lora_B"})
    if lonely:
        raise WeightUpdateError(f"adapter modules without both lora_A and lora_B: {lonely[:4]}")
    if (bad := first_non_finite(adapter.tensors)) is not None:
        raise WeightUpdateError(f"adapter tensor {bad}: contains NaN or infinite values")
    return cfg


def _split(name: str) -> tuple[str, str]:
    """``base_model.model.{module}.lora_A.weight`` -> (module, "lora_A")."""
    parts = name.removeprefix(_PEFT_PREFIX).split(".")
    if name.startswith(_PEFT_PREFIX) and len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A",
                                                                                                       "lora_B"):
        return ".".join(parts[:-2]), parts[-2]
    raise WeightUpdateError(f"adapter tensor {name!r} is not named as in a PEFT adapter file "
                            f"({_PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")


def adapter_dir_files(adapter: Mapping[str, torch.Tensor], cfg: LoraConfig, dtype: torch.dtype
                      ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The tensors and ``adapter_config.json`` of a PEFT adapter directory holding ``adapter`` (shaped ``cfg``)."""
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
                "target_modules": sorted(cfg.target_modules), "lora_dropout": cfg.dropout, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.items()}
    return tensors, settings


async def _check_and_write(adapter: WeightSource, manifest: Mapping[str, ParamSpec], max_rank: int,
                           dtype: torch.dtype, root: Path | None) -> StagedWeights:
    """``check_adapter`` (its NaN pass reads every tensor) and the write, both in a worker thread, as full-weight
    updates are checked and staged: the event loop keeps serving."""
    return await stage_in_thread(lambda abandon: _write_adapter_now(adapter, manifest, max_rank, dtype, root, abandon))


def _write_adapter_now(adapter: WeightSource, manifest: Mapping[str, ParamSpec], max_rank: int,
                       dtype: torch.dtype, root: Path | None, abandon: threading.Event) -> StagedWeights:
    from safetensors.torch import save_file

    cfg = check_adapter(adapter, manifest, max_rank)
    if abandon.is_set():
        raise StageAbandoned
    tmp = make_staging_dir(root)
    try:
        tensors, settings = adapter_dir_files(adapter.tensors, cfg, dtype)
        save_file(tensors, str(tmp / ADAPTER_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(settings))
    except BaseException:
        StagedWeights(tmp).release()
        raise
    return StagedWeights(tmp)
