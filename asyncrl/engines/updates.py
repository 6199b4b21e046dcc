"""What a publication carries: a version and a typed source of weights.

Every source declares what it carries (``kind``: every weight, or a LoRA adapter) and offers what a transport
reads, so that no transport or engine matches on its type:

- ``tensors``: its tensors by name (read from files as they are asked for, where it is held in files);
- ``files`` / ``file_specs``: the staged files already holding it and their headers, None where it is in memory;
- ``adapter_config``: an adapter's shape (None for full weights); ``detached()``: a CPU copy that owns its tensors.

The sources:

- ``InMemory``: checkpoint-format tensors in this process (a single-device learner's state dict);
- ``StagedDirectory``: safetensors files already written to a staging directory, e.g. by the first member of
  a pool, which the others adopt as they are instead of writing their own;
- ``ShardedBuckets``: a sharded learner's gathered buckets, staged by rank 0 (``distributed.publication``), read
  back tensor by tensor only where a transport needs tensors;
- ``AdapterWeights``: a LoRA adapter's tensors and shape, for engines that serve adapters on a frozen base.

An engine's transport declares the kinds it carries (``transports.base.WeightTransport.accepts``); the engine
refuses any other kind in ``prepare``, before anything is staged. ``WeightUpdate.staged`` is what the target's
transport made of the update in ``prepare``; only that transport reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from asyncrl.errors import WeightUpdateError

if TYPE_CHECKING:
    import torch

    from asyncrl.engines.weights import ParamSpec, StagedTensors, StagedWeights
    from asyncrl.lora.config import LoraConfig

__all__ = ["AdapterWeights", "InMemory", "ShardedBuckets", "StagedDirectory", "StagedInEngine", "UpdateKind",
           "WeightSource", "WeightUpdate", "as_source", "check_kind", "model_source"]


class UpdateKind(str, enum.Enum):
    """What a publication replaces in the engine."""

    FULL = "full"  # every weight of the served model, under checkpoint names
    ADAPTER = "adapter"  # a LoRA adapter for the frozen base the engine serves


class WeightSource:
    """The role every source plays (its subclasses are frozen dataclasses holding the data)."""

    __slots__ = ()
    kind: ClassVar[UpdateKind]  # what it carries: declared by each source
    # Its tensors by checkpoint (or PEFT adapter-file) name: a field or a property of each source (a default
    # here would become the dataclass fields' default).
    tensors: Mapping[str, torch.Tensor]

    @property
    def files(self) -> StagedWeights | None:
        """The staged safetensors files that hold it already, for a files transport to adopt (acquiring them);
        None: it is held in memory."""
        return None

    @property
    def file_specs(self) -> Mapping[str, ParamSpec] | None:
        """Names, shapes and dtypes of ``files``, from their headers (no tensor data); None in memory."""
        return None

    @property
    def adapter_config(self) -> LoraConfig | None:
        """The shape an adapter was trained with; None for full weights."""
        return None

    def detached(self) -> WeightSource:
        """A CPU copy that owns its tensors (what a supervisor keeps to restore a restarted engine)."""
        return InMemory(_cpu_copy(self.tensors))


@dataclass(frozen=True, slots=True)
class InMemory(WeightSource):
    """Every parameter of the served model, by checkpoint name (as in the model's ``state_dict``)."""

    kind: ClassVar[UpdateKind] = UpdateKind.FULL
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class StagedDirectory(WeightSource):
    """Every parameter, as safetensors files in a staging directory. The handle counts its holders: an engine
    that adopts the files acquires it, so one copy serves N engines of a pool."""

    kind: ClassVar[UpdateKind] = UpdateKind.FULL
    staged: StagedWeights

    @property
    def tensors(self) -> StagedTensors:
        from asyncrl.engines.weights import StagedTensors

        return StagedTensors(self.staged)

    @property
    def files(self) -> StagedWeights:
        return self.staged

    @property
    def file_specs(self) -> Mapping[str, ParamSpec]:
        from asyncrl.engines.weights import read_manifest

        return read_manifest(self.staged.path)  # headers only: no tensor view is needed


@dataclass(frozen=True, slots=True)
class ShardedBuckets(WeightSource):
    """Every parameter, gathered from a sharded learner bucket by bucket and staged by rank 0."""

    kind: ClassVar[UpdateKind] = UpdateKind.FULL
    buckets: StagedTensors

    @property
    def tensors(self) -> StagedTensors:
        return self.buckets

    @property
    def files(self) -> StagedWeights:
        return self.buckets.staged

    @property
    def file_specs(self) -> Mapping[str, ParamSpec]:
        return self.buckets.specs


@dataclass(frozen=True, slots=True)
class AdapterWeights(WeightSource):
    """A LoRA adapter for the served base model: its tensors under the names of PEFT's adapter file
    (``...q_proj.lora_A.weight``) and the shape they were trained with."""

    kind: ClassVar[UpdateKind] = UpdateKind.ADAPTER
    tensors: Mapping[str, torch.Tensor]
    config: LoraConfig

    @property
    def adapter_config(self) -> LoraConfig:
        return self.config

    def detached(self) -> AdapterWeights:
        return AdapterWeights(_cpu_copy(self.tensors), self.config)


def _cpu_copy(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


@dataclass(frozen=True, slots=True)
class StagedInEngine:
    """``WeightUpdate.staged`` when the engine itself holds the new weights beside the live ones (CUDA IPC into
    shadow parameters, an embedded service's prepared update): loading them is one copy inside the engine."""

    version: int


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """New policy weights to publish, as ``version`` once loaded."""

    version: int
    source: WeightSource
    staged: Any = None  # set by the target's ``prepare``: its transport's own handle, read by its ``load``

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The source's tensors (a staged directory's are read from its files as they are asked for)."""
        return self.source.tensors


def model_source(model: torch.nn.Module) -> WeightSource:
    """What publishing ``model`` sends: its adapter alone when it trains through LoRA (``asyncrl.lora``), else
    every weight (``state_dict_for_engine``). Shares storage with the live parameters."""
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.lora.model import adapter_config, adapter_state, is_lora

    if is_lora(model):
        return AdapterWeights(adapter_state(model), adapter_config(model))
    return InMemory(state_dict_for_engine(model))


def as_source(weights: torch.nn.Module | WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """What a caller hands a publication, as a source: a source as it is, a model as ``model_source``, a plain
    mapping of tensors as ``InMemory``. The one place a caller's input is told apart (a declared source against
    a model or raw tensors), never one source type against another."""
    import torch

    if isinstance(weights, WeightSource):
        return weights
    return model_source(weights) if isinstance(weights, torch.nn.Module) else InMemory(weights)


def check_kind(engine: str, carrier: str, accepts: frozenset[UpdateKind], update: WeightUpdate) -> None:
    """Refuse, before anything is staged, an update whose kind ``carrier`` (a transport, say) does not carry,
    naming both and what to do instead."""
    kind = update.source.kind
    if kind in accepts:
        return
    carried = " or ".join(sorted(k.value for k in accepts)) or "no"
    raise WeightUpdateError(f"engine {engine}: its {carrier} carries {carried} updates, not this {kind.value} update "
                            f"(version {update.version}): {_REFUSED_HINTS[kind]}")


_REFUSED_HINTS = {
    UpdateKind.ADAPTER: "it serves full weights and cannot load a LoRA adapter; start it with LoRA serving "
                        "(VLLMEngineConfig.lora, RemoteEngineConfig.lora)",
    UpdateKind.FULL: "it serves LoRA adapters on a frozen base; publish the adapter (asyncrl.lora)",
}
