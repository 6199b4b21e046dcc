"""The vocabulary of multi-turn episodes: an environment, what it answers to each model turn, and what an
episode yields.

An episode starts from a ``Prompt``: its token ids are the first context. Each model turn is one
``Sampler.generate`` call on the whole context so far; the environment then receives exactly the ids the model
sampled (the turn's ``Sample``) and answers with a ``StepResult``: the ids it appends (a tool's output, the
user's next turn, chat-template tokens), a reward and whether the episode is over. Contexts grow by
concatenating ids, never by decoding and encoding text again, so the ids trained are the ids sampled.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from asyncrl.types import Prompt, Sample, Trajectory


@dataclass(frozen=True, slots=True)
class StepResult:
    """The environment's answer to one model turn."""

    token_ids: tuple[int, ...] = ()  # ids appended to the context after the turn; never trained on
    reward: float = 0.0  # this step's reward; an episode's environment reward is the sum over its steps
    done: bool = False  # the episode ends after this step (its ``token_ids`` are still appended if they fit)
    text: str = ""  # ``token_ids`` as text, for logs and trajectory-level reward functions
    tool_calls: int = 0  # tool calls made in this step (metrics)
    tool_errors: int = 0  # of those, calls that failed: the tool raised, or there is no such tool

    def __post_init__(self) -> None:
        ids = self.token_ids
        if not isinstance(ids, tuple | list) or not all(type(t) is int and t >= 0 for t in ids):
            raise ValueError(f"StepResult.token_ids must be token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "token_ids", tuple(ids))
        if isinstance(self.reward, bool) or not isinstance(self.reward, int | float) or not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward must be a finite number, got {self.reward!r}")
        for name in ("tool_calls", "tool_errors"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"StepResult.{name} must be an integer >= 0, got {value!r}")
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"StepResult: {self.tool_errors} tool errors but {self.tool_calls} tool calls")


@runtime_checkable
class Env(Protocol):
    """One episode's environment. Made per episode by an ``EnvFactory``; every call is bounded by
    ``EpisodeConfig.env_timeout_s``."""

    async def step(self, turn: Sample) -> StepResult:
        """Called after each model turn with exactly what the model sampled: ``turn.token_ids`` (and its
        log-probs, finish reason and text). An exception drops the group (``env_error``); raise
        ``RolloutDropped`` to drop it with a reason of your own."""
        ...

    async def close(self) -> None:
        """Release what the episode held (a sandbox, a connection). Called once per episode, also when it
        failed or was cancelled; a close that fails or overruns is logged, the episode is kept."""
        ...


EnvFactory = Callable[[Prompt], "Env | Awaitable[Env]"]  # one environment per episode, sync or async


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode."""

    trajectory: Trajectory  # the flat token sequence after the prompt, with its loss mask and spans over model tokens
    env_reward: float  # sum of the environment's step rewards
    turns: int  # model turns sampled (a turn cut by an ``abort`` pause and sampled again counts once)
    tool_calls: int  # tool calls reported by the environment's steps
    tool_errors: int  # of those, the ones that failed
    env_s: float  # wall time in environment calls (creation, steps and their tools, close), seconds
