"""Engines behind one narrow Protocol: in-process vLLM, remote vLLM servers, a pool, and a fake."""

from asyncrl.engines.base import Engine, EngineError, PromptRejected, WeightUpdate, WeightUpdateError

__all__ = ["Engine", "EngineError", "PromptRejected", "WeightUpdate", "WeightUpdateError"]
