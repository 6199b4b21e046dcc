"""Engines by role (``protocols``), what a publication carries (``updates``), the one seam weights cross into an
engine (``transports``), and engines by kind: vLLM in this process (``vllm_local``), vLLM servers over
HTTP (``vllm_remote``), an engine embedded in another service (``embedded``); plus a pool, a supervisor that
restarts a dead engine, and an in-memory fake for tests. ``state_dict_for_engine(model)``: the tensors of a
transformers model as an engine takes them."""

from asyncrl.engines.protocols import (
    BehaviourPrecision, Engine, EngineError, Lifecycle, PromptRejected, Sampler, WeightTarget, WeightUpdate,
    WeightUpdateError,
)
from asyncrl.engines.updates import (AdapterWeights, InMemory, ShardedBuckets, StagedDirectory, UpdateKind,
                                     WeightSource)
from asyncrl.engines.weights import state_dict_for_engine

__all__ = ["AdapterWeights", "BehaviourPrecision", "Engine", "EngineError", "InMemory", "Lifecycle",
           "PromptRejected", "Sampler", "ShardedBuckets", "StagedDirectory", "UpdateKind", "WeightSource",
           "WeightTarget", "WeightUpdate", "WeightUpdateError", "state_dict_for_engine"]
