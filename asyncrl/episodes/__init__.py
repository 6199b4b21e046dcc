"""Multi-turn and tool-use episodes: token-in/token-out environments, flat trajectories with a loss mask.

- ``types``: ``Env`` (async ``step(turn) -> StepResult``, ``close()``), ``EnvFactory``, ``StepResult``, ``Episode``.
- ``trajectory``: ``TrajectoryBuilder`` (ids concatenated, never re-tokenised), ``turn_slices``, ``model_token_ids``.
- ``runner``: ``EpisodeRunner`` (one ``Sampler.generate`` per turn, pauses and limits, drops) and ``EpisodeCounters``.
- ``tools``: ``ToolBox`` (async functions by name, with a timeout), ``ToolEnv`` (call-or-answer loop).
- ``groups``: ``EpisodeGroups``, the group maker: ``n`` episodes per prompt (``grpo_pipeline(engine, model, prompts,
  EpisodeGroups(env))``).
"""

from asyncrl.episodes.groups import EpisodeGroups
from asyncrl.episodes.runner import EpisodeCounters, EpisodeRunner
from asyncrl.episodes.tools import Tool, ToolBox, ToolCall, ToolEnv, ToolResult
from asyncrl.episodes.trajectory import TrajectoryBuilder, model_token_ids, turn_slices
from asyncrl.episodes.types import Env, EnvFactory, Episode, StepResult

__all__ = ["Env", "EnvFactory", "Episode", "EpisodeCounters", "EpisodeGroups", "EpisodeRunner", "StepResult", "Tool",
           "ToolBox", "ToolCall", "ToolEnv", "ToolResult", "TrajectoryBuilder", "model_token_ids", "turn_slices"]
