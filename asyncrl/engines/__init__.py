"""Engines by role (``protocols``) and by transport: vLLM in this process (``vllm_local``), vLLM servers over
HTTP (``vllm_remote``), an engine embedded in another service (``embedded``); plus a pool, a supervisor that
restarts a dead engine, and an in-memory fake for tests. ``state_dict_for_engine(model)``: the tensors of a
transformers model as an engine takes them."""

from asyncrl.engines.protocols import (
    Engine, EngineError, Lifecycle, PromptRejected, Sampler, WeightTarget, WeightUpdate, WeightUpdateError,
)
from asyncrl.engines.weights import state_dict_for_engine

__all__ = ["Engine", "EngineError", "Lifecycle", "PromptRejected", "Sampler", "WeightTarget", "WeightUpdate",
           "WeightUpdateError", "state_dict_for_engine"]
