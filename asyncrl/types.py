"""Message types that flow through the pipeline, and the words for them.

Data flows one way: ``Prompt`` -> producer -> engine (``Sample``) -> producer (``Rollout``s in a
``RolloutGroup``) -> queue -> learner. Weight versions are integers owned by the learner's ``VersionClock``:
version 0 is the initial policy, every publication makes the next one. Nothing here is stored twice: the
versions that produced a rollout live in its sample's spans, its prompt in its group.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class PauseMode(str, enum.Enum):
    """How in-flight requests are treated while the learner publishes new weights."""

    ABORT = "abort"  # cut in-flight requests now; they finish with reason ``abort``
    WAIT = "wait"  # let in-flight requests finish under the old weights, then pause
    KEEP = "keep"  # freeze in-flight requests; they continue under the new weights


class FinishReason(str, enum.Enum):
    """Why a completion ended."""

    STOP = "stop"  # an end-of-sequence or stop token was sampled
    LENGTH = "length"  # ``max_tokens`` or the context length was reached
    ABORT = "abort"  # the request was cut by an ``abort`` pause or cancellation


class DropReason(str, enum.Enum):
    """Why a rollout group never reached the loss. Every drop is counted under one of these."""

    STALE = "stale"  # older than ``max_staleness`` when the learner took it (or when the version moved)
    ABORTED = "aborted"  # cut by an ``abort`` pause and the producer is set to drop such groups
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt leaves no room to generate in the engine's context
    EMPTY_PROMPT = "empty_prompt"  # prompt has no tokens
    REWARD_ERROR = "reward_error"  # the reward function raised
    REWARD_INVALID = "reward_invalid"  # the reward function returned NaN, inf or a non-number
    REWARD_TIMEOUT = "reward_timeout"  # the reward function took longer than ``reward_timeout_s``
    ENGINE_ERROR = "engine_error"  # the engine rejected the request
    UNUSED_AT_SHUTDOWN = "unused_at_shutdown"  # still queued or in flight when the run ended


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Completion tokens ``[start, end)`` were sampled under weight version ``version``.

    A completion with no tokens carries one empty span ``(v, 0, 0)``: the version it was requested under."""

    version: int
    start: int  # index of the first completion token (0-based), inclusive
    end: int  # index one past the last completion token, exclusive


@dataclass(frozen=True, slots=True)
class Prompt:
    """One task instance: the tokens to generate from, plus whatever the reward function needs."""

    prompt_id: str  # stable id of the data item (used for idempotency and data cursors)
    token_ids: tuple[int, ...]  # tokenised prompt fed to the engine
    text: str = ""  # the prompt as text, for logging and reward functions
    answer: Any = None  # reference answer or metadata for the reward function


@dataclass(frozen=True, slots=True)
class Sample:
    """One completion as the engine produced it."""

    token_ids: tuple[int, ...]  # sampled completion tokens
    logprobs: tuple[float, ...]  # behaviour log-prob of each sampled token (nats), same length
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]  # weight versions over the tokens; at least one span, see VersionSpan
    text: str = ""  # detokenised completion

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"sample of {len(self.token_ids)} tokens has {len(self.logprobs)} log-probs")

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced a token of this sample."""
        return self.version_spans[0].version

    @property
    def newest_version(self) -> int:
        return self.version_spans[-1].version


@dataclass(frozen=True, slots=True)
class Rollout:
    """A scored sample, ready for training (its prompt is its group's)."""

    sample: Sample
    reward: float


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """The ``n`` rollouts of one prompt, sampled together (the unit GRPO normalises over)."""

    group_id: str  # unique and stable: retries of the same group carry the same id
    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)  # free-form producer metadata

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced any token of the group."""
        return min(r.sample.oldest_version for r in self.rollouts)

    @property
    def newest_version(self) -> int:
        return max(r.sample.newest_version for r in self.rollouts)

    def staleness(self, policy_version: int) -> int:
        """How many weight updates old the group's oldest token is, seen from ``policy_version``."""
        return policy_version - self.oldest_version

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(r.reward for r in self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.sample.token_ids) for r in self.rollouts)


@dataclass(frozen=True, slots=True)
class SyncTiming:
    """Wall times of one weight publication, split by phase (seconds)."""

    version: int  # the version published
    pause_s: float  # pause call until generation is paused
    transfer_s: float  # weights loaded into the engine while paused
    resume_s: float  # resume call
    total_s: float  # pause call until resume returned (generation paused for about this long)
    mode: PauseMode
    clear_cache: bool
    prepare_s: float = 0.0  # checks + staging done before the pause (generation kept running)
