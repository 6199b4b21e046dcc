"""What a publication carries: a version and a typed source of weights.

A source says where the new weights are, so that each transport reads them the cheapest way it can:

- ``InMemory``: checkpoint-format tensors in this process (a single-device learner's state dict);
- ``StagedDirectory``: safetensors files already written to a staging directory, e.g. by the first member of
  a pool, which the others adopt as they are instead of writing their own;
- ``ShardedBuckets``: a sharded learner's gathered buckets, staged by rank 0 (``distributed.publication``), read
  back tensor by tensor only where a transport needs tensors;
- ``AdapterWeights``: a LoRA adapter's tensors and shape, for engines that serve adapters on a frozen base.

``WeightUpdate.staged`` is what the target's transport made of the update in ``prepare``; only that transport
reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from asyncrl.engines.weights import ParamSpec, StagedTensors, StagedWeights
    from asyncrl.lora.config import LoraConfig

__all__ = ["AdapterWeights", "InMemory", "ShardedBuckets", "StagedDirectory", "StagedInEngine", "WeightSource",
           "WeightUpdate", "as_source", "detached", "file_specs", "model_source"]


@dataclass(frozen=True, slots=True)
class InMemory:
    """Every parameter of the served model, by checkpoint name (as in the model's ``state_dict``)."""

    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class StagedDirectory:
    """Every parameter, as safetensors files in a staging directory. The handle counts its holders: an engine
    that adopts the files acquires it, so one copy serves N engines of a pool."""

    staged: StagedWeights

    @property
    def tensors(self) -> StagedTensors:
        from asyncrl.engines.weights import StagedTensors

        return StagedTensors(self.staged)


@dataclass(frozen=True, slots=True)
class ShardedBuckets:
    """Every parameter, gathered from a sharded learner bucket by bucket and staged by rank 0."""

    buckets: StagedTensors

    @property
    def tensors(self) -> StagedTensors:
        return self.buckets


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A LoRA adapter for the served base model: its tensors under the names of PEFT's adapter file
    (``...q_proj.lora_A.weight``) and the shape they were trained with."""

    tensors: Mapping[str, torch.Tensor]
    config: LoraConfig


WeightSource = InMemory | StagedDirectory | ShardedBuckets | AdapterWeights


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


def file_specs(source: WeightSource) -> Mapping[str, ParamSpec] | None:
    """Names, shapes and dtypes of a source already written to files (read from their headers, no tensor data);
    None for tensors in memory."""
    match source:
        case StagedDirectory() | ShardedBuckets():
            return source.tensors.specs
    return None


def model_source(model: torch.nn.Module) -> WeightSource:
    """What publishing ``model`` sends: its adapter alone when it trains through LoRA (``asyncrl.lora``), else
    every weight (``state_dict_for_engine``). Shares storage with the live parameters."""
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.lora.model import adapter_config, adapter_state, is_lora

    if is_lora(model):
        return AdapterWeights(adapter_state(model), adapter_config(model))
    return InMemory(state_dict_for_engine(model))


def as_source(weights: WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """A source as it is; a plain mapping of tensors as ``InMemory``."""
    if isinstance(weights, InMemory | StagedDirectory | ShardedBuckets | AdapterWeights):
        return weights
    return InMemory(weights)


def detached(source: WeightSource) -> WeightSource:
    """A CPU copy of ``source`` that owns its tensors (what a supervisor keeps to restore a restarted engine)."""
    copy = {k: v.detach().to("cpu", copy=True) for k, v in source.tensors.items()}
    if isinstance(source, AdapterWeights):
        return AdapterWeights(copy, source.config)
    return InMemory(copy)
