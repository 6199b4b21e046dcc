"""LoRA adapters: publication sends the adapter alone (a few MiB) into an engine that serves the frozen base model
with vLLM's LoRA support, in this process (``VLLMEngineConfig.lora``) or in a server (``RemoteEngineConfig.lora``).

``stage`` checks the adapter against the served base model (every adapted module exists, ``A`` is rank x in and
``B`` out x rank, the rank fits the engine's ``max_rank``, no NaN), then registers it with the engine under a new
name and id for its version (``asyncrl-v{version}``), all before the pause: a new adapter changes nothing a request
already runs with, so generation goes on while it travels. The in-process engine takes it from memory (its
tensors as one buffer through the workers, ``lora.in_process``); a server registers adapter names only through
``/v1/load_lora_adapter``, which reads a directory, so its port writes one in shared memory (``lora.server``).
Under the pause, ``load`` only confirms the engine still holds the adapter and makes it current: requests
submitted from then on name it (``checkout``). vLLM fixes a request's adapter when the request is submitted, so
with one adapter per version every token a request samples comes from one known adapter, and the request's
version is that adapter's.

Across the pause, by mode:

- ``abort``: requests in flight end at once with the tokens sampled so far, all from the old adapter;
- ``wait``: requests in flight finish on the old adapter before the switch; none is in flight across it;
- ``keep``: requests in flight are frozen and, after the resume, go on with the adapter they were submitted with
  (the old one) to their end; their tokens carry the old version, and the staleness filter and the importance
  weights treat them as such.

An old adapter is removed from the engine once no request holds it any more; one staged and never made current
(a publication that failed or was cancelled after staging) is removed too. The engine keeps every registered
adapter (``max_cpu_loras`` bounds them, and staging refuses a new one beyond it rather than let vLLM evict one a
request still names). A switch to an adapter the engine no longer lists is refused: the engine would otherwise go
on serving another version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

import torch
from pydantic import Field

from asyncrl.config_base import PositiveInt, config
from asyncrl.engines.transports.base import Transport
from asyncrl.engines.updates import StagedInEngine, UpdateKind, WeightSource, WeightUpdate
from asyncrl.engines.weights import ParamSpec, first_non_finite
from asyncrl.errors import EngineError, WeightUpdateError

if TYPE_CHECKING:
    from asyncrl.lora.config import LoraConfig

__all__ = ["AdapterContents", "AdapterPort", "AdapterTransport", "LoraServingConfig", "ServedAdapter"]

log = logging.getLogger(__name__)

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
        "adapters the engine keeps registered: the current one, one staged for the next version, and old ones "
        "that requests frozen by keep pauses still name. Publication refuses to stage beyond it (vLLM would evict "
        "an adapter a request may still name)"))] = 8

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

    @classmethod
    def of_version(cls, version: int) -> ServedAdapter:
        return cls(version, f"asyncrl-v{version}", version + 1)


@dataclass(frozen=True, slots=True)
class AdapterContents:
    """What a PEFT adapter directory would hold, in memory: the tensors (on the CPU, in the served dtype, named
    as in ``adapter_model.safetensors``) and the ``adapter_config.json`` fields."""

    tensors: Mapping[str, torch.Tensor]
    settings: dict[str, Any]

    def serialise(self) -> bytes:
        """The tensors as one safetensors buffer (what the in-process workers take)."""
        from safetensors.torch import save

        return save(dict(self.tensors))


class AdapterPort(Protocol):
    """The engine's side: registering and removing adapters (in-process calls, or a server's endpoints)."""

    async def add(self, adapter: ServedAdapter, contents: AdapterContents) -> None:
        ...

    async def remove(self, adapter: ServedAdapter) -> None:
        ...

    async def holds(self, adapter: ServedAdapter) -> bool:
        """Whether the engine has ``adapter`` registered now."""
        ...

    async def close(self) -> None:
        """Free what the port keeps outside the engine (a server's adapter directories)."""
        ...


class AdapterTransport(Transport):
    """Adapter-only publication; also tells the engine which adapter each new request must name."""

    kind = "lora"
    accepts = frozenset({UpdateKind.ADAPTER})

    def __init__(self, engine: str, port: AdapterPort, manifest: Mapping[str, ParamSpec], serving: LoraServingConfig,
                 dtype: torch.dtype) -> None:
        self._engine = engine
        self._port = port
        self._manifest = manifest
        self._serving = serving
        self._dtype = dtype
        self._current: ServedAdapter | None = None  # None: the base model, version 0
        self._staged: dict[int, ServedAdapter] = {}  # registered for a version not loaded yet
        self._holders: dict[ServedAdapter, int] = {}  # requests in flight on each adapter
        self._retired: list[ServedAdapter] = []  # replaced or never loaded, to remove once no request holds them

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
        adapter = ServedAdapter.of_version(update.version)
        # A worker thread, as full-weight updates are checked and staged: the event loop keeps serving. Nothing
        # it makes outlives a cancelled caller but memory.
        contents = await asyncio.to_thread(_checked_contents, update.source, self._manifest, self._serving.max_rank,
                                           self._dtype)
        await self._make_room()
        self._staged[update.version] = adapter  # from here on, a failure leaves it to remove (``release``)
        await self._confirm(adapter, contents)
        return replace(update, staged=StagedInEngine(update.version))

    async def load(self, update: WeightUpdate) -> None:
        adapter = self._staged.get(update.version)
        if adapter is None or update.staged != StagedInEngine(update.version):
            raise WeightUpdateError(f"engine {self._engine}: version {update.version} was not prepared")
        await self._confirm(adapter)
        del self._staged[update.version]
        if self._current is not None:
            self._retired.append(self._current)
        self._current = adapter
        await self._remove_unheld()

    def release(self, update: WeightUpdate) -> None:
        adapter = self._staged.pop(update.version, None)
        if adapter is not None:  # staged and never made current: removed at the next publication
            self._retired.append(adapter)

    async def close(self) -> None:
        await self._port.close()

    async def _confirm(self, adapter: ServedAdapter, contents: AdapterContents | None = None) -> None:
        """Register ``adapter`` with ``contents`` (None: it was registered before), then check that the engine
        lists it; a failure of either leaves the served version as it was, and says so."""
        doing = "registering" if contents is not None else "confirming"
        try:
            if contents is not None:
                await self._port.add(adapter, contents)
            held = await self._port.holds(adapter)
        except EngineError:
            raise
        except Exception as exc:
            raise WeightUpdateError(f"engine {self._engine}: {doing} adapter {adapter.name} failed ({exc!r}); it "
                                    f"serves version {self._version_served()} still") from exc
        if not held:
            raise WeightUpdateError(f"engine {self._engine} does not hold adapter {adapter.name} ({doing}); it "
                                    f"serves version {self._version_served()} still")

    def _version_served(self) -> int:
        return 0 if self._current is None else self._current.version

    def _registered(self) -> int:
        return len(self._staged) + len(self._retired) + (self._current is not None)

    async def _make_room(self) -> None:
        """Remove what no request holds; refuse to register beyond ``max_cpu_loras``."""
        await self._remove_unheld()
        if self._registered() >= self._serving.max_cpu_loras:
            raise WeightUpdateError(
                f"engine {self._engine} holds {self._registered()} adapters, requests in flight still naming "
                f"{len(self._retired)} old ones: one more exceeds LoraServingConfig.max_cpu_loras "
                f"{self._serving.max_cpu_loras} (raise it, or publish less often than requests run)")

    async def _remove_unheld(self) -> None:
        """Remove the retired adapters no request holds any more (nothing new can hold them: only the current
        adapter is handed out)."""
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


def adapter_settings(cfg: LoraConfig) -> dict[str, Any]:
    """The ``adapter_config.json`` fields of an adapter shaped ``cfg``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "target_modules": sorted(cfg.target_modules), "lora_dropout": cfg.dropout, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def _checked_contents(adapter: WeightSource, manifest: Mapping[str, ParamSpec], max_rank: int, dtype: torch.dtype
                      ) -> AdapterContents:
    """``check_adapter`` (its NaN pass reads every tensor) and a copy in the served dtype on the CPU."""
    cfg = check_adapter(adapter, manifest, max_rank)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.tensors.items()}
    return AdapterContents(tensors, adapter_settings(cfg))
