"""Message types that flow through the pipeline.

Data flows one way: ``Prompt`` -> producer -> engine (``Sample``) -> producer (``Rollout`` in a
``RolloutGroup``) -> queue -> learner. Weight versions are integers owned by the learner: version 0 is
the initial policy, and every weight sync publishes ``version + 1``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
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

    STALE = "stale"  # older than ``max_staleness`` when the learner took it
    ABORTED = "aborted"  # cut by an ``abort`` pause and the producer is set to drop such groups
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt leaves no room to generate in the engine's context
    EMPTY_PROMPT = "empty_prompt"  # prompt has no tokens
    REWARD_ERROR = "reward_error"  # the reward function raised
    REWARD_INVALID = "reward_invalid"  # the reward function returned NaN, inf or a non-number
    ENGINE_ERROR = "engine_error"  # the engine rejected the request
    UNUSED_AT_SHUTDOWN = "unused_at_shutdown"  # still queued or in flight when the run ended


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Completion tokens ``[start, end)`` were sampled under weight version ``version``."""

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
    """One completion as the engine produced it (before scoring)."""

    token_ids: tuple[int, ...]  # sampled completion tokens
    logprobs: tuple[float, ...]  # behaviour log-prob of each sampled token (nats), same length
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]  # weight version per token range; covers all tokens
    text: str = ""  # detokenised completion

    @property
    def version_start(self) -> int:
        return self.version_spans[0].version if self.version_spans else -1

    @property
    def version_end(self) -> int:
        return self.version_spans[-1].version if self.version_spans else -1


@dataclass(frozen=True, slots=True)
class Rollout:
    """A scored completion, ready for training."""

    group_id: str  # id of the group (prompt x sampling round) this rollout belongs to
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]  # per completion token, from the engine that sampled it
    reward: float
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]  # per-token weight versions (see ``VersionSpan``)
    version_start: int  # weight version when the first token was sampled
    version_end: int  # weight version when the last token was sampled
    text: str = ""

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"rollout {self.group_id}: {len(self.completion_ids)} completion tokens but "
                f"{len(self.behaviour_logprobs)} behaviour log-probs"
            )


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """The ``n`` rollouts of one prompt, sampled together (the unit GRPO normalises over)."""

    group_id: str  # unique and stable: retries of the same group carry the same id
    prompt: Prompt
    rollouts: tuple[Rollout, ...]
    created_at: float = 0.0  # time.monotonic() when the group was queued (seconds)
    meta: Mapping[str, Any] = field(default_factory=dict)  # free-form producer metadata

    def stamped(self, created_at: float) -> RolloutGroup:
        """A copy with ``created_at`` set (the queue stamps each group on arrival): what
        ``dataclasses.replace(self, created_at=created_at)`` gives, at less than half its cost per group."""
        if type(self) is not RolloutGroup:  # a subclass may have fields of its own
            return replace(self, created_at=created_at)
        return RolloutGroup(self.group_id, self.prompt, self.rollouts, created_at, self.meta)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced any token of the group."""
        return min(r.version_start for r in self.rollouts)

    @property
    def newest_version(self) -> int:
        return max(r.version_end for r in self.rollouts)

    def staleness(self, current_version: int) -> int:
        """How many weight updates old the group's oldest token is, seen from ``current_version``."""
        return current_version - self.oldest_version

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(r.reward for r in self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.completion_ids) for r in self.rollouts)


# ``RolloutGroup.stamped`` lists the fields by hand: a new field must be added there too.
if tuple(f.name for f in fields(RolloutGroup)) != ("group_id", "prompt", "rollouts", "created_at", "meta"):
    raise TypeError("RolloutGroup's fields changed: update RolloutGroup.stamped")


@dataclass(frozen=True, slots=True)
class SyncTiming:
    """Wall times of one weight publication, split by phase (seconds)."""

    version: int  # the version published
    pause_s: float  # pause_generation call until generation is paused
    transfer_s: float  # weights loaded into the engine while paused
    resume_s: float  # resume_generation call
    total_s: float  # lock acquired until resume returned (generation paused for about this long)
    mode: PauseMode
    clear_cache: bool
    prepare_s: float = 0.0  # checks + serialisation done before the pause (generation kept running)
