"""Message types that flow through the pipeline, and the words for them.

Data flows one way: ``Prompt`` -> producer -> engine (``Sample``) -> producer (``Rollout``s in a
``RolloutGroup``) -> queue -> learner. Weight versions are integers owned by the learner's ``VersionClock``:
version 0 is the initial policy, every publication makes the next one. Nothing here is stored twice: the
versions that produced a rollout live in its sample's spans, its prompt in its group.

A multi-turn episode (``asyncrl.episodes``) is a ``Trajectory``, a ``Sample`` too: its ``token_ids`` are every
token after the prompt, the model's turns and the environment's tokens between them, flat and in order, and its
``loss_mask`` says which are the model's. Environment tokens have no weight version and no behaviour log-prob:
spans cover model tokens only, and the log-prob at an environment token is 0.0.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


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
    ENV_ERROR = "env_error"  # an episode's environment raised (or returned something that is not a StepResult)
    ENV_TIMEOUT = "env_timeout"  # an environment call took longer than ``EpisodeConfig.env_timeout_s``
    TOOL_TIMEOUT = "tool_timeout"  # a tool call took longer than its ``ToolBox`` timeout
    ENV_OUTPUT_TOO_LONG = "env_output_too_long"  # one environment step returned more than ``max_env_tokens`` ids
    # a prompt, or the ids an environment step returned, hold an id outside the engine's ``Sampler.vocab_size``
    OUT_OF_VOCABULARY = "out_of_vocabulary"
    JUDGE_ERROR = "judge_error"  # a pairwise judge raised
    JUDGE_INVALID = "judge_invalid"  # a pairwise judge returned something that is not a probability
    JUDGE_TIMEOUT = "judge_timeout"  # a group's comparisons took longer than ``reward_timeout_s``
    PREFERENCE_TIE = "preference_tie"  # every comparison of the group tied: no pair to learn from
    AGENT_ERROR = "agent_error"  # an agent behind the OpenAI endpoint raised, or its episodes share no prompt
    AGENT_TIMEOUT = "agent_timeout"  # a group's agents took longer than ``AgentConfig.timeout_s``
    AGENT_IDLE = "agent_idle"  # an agent ended without a completion call: nothing to train
    UNUSED_AT_SHUTDOWN = "unused_at_shutdown"  # still queued or in flight when the run ended

    @property
    def is_outcome(self) -> bool:
        """A drop that is how things went (a pause cut it, the judge saw no difference, the run moved on), not
        something wrong with the input: ``InvalidGroupPolicy.FAIL`` stops the run only for the others."""
        return self in _OUTCOMES


_OUTCOMES = frozenset({DropReason.STALE, DropReason.ABORTED, DropReason.PREFERENCE_TIE, DropReason.UNUSED_AT_SHUTDOWN})


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Completion tokens ``[start, end)`` were sampled under weight version ``version``.

    A completion with no tokens carries one empty span ``(v, 0, 0)``: the version it was requested under. In a
    ``Trajectory`` spans index the flat sequence and cover exactly its model
    tokens, never an environment token: they are ordered, and a span never crosses from one turn to the next
    through environment tokens."""

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

    token_ids: tuple[int, ...]  # sampled completion tokens (a trajectory: model and environment tokens, in order)
    logprobs: tuple[float, ...]  # behaviour log-prob of each token (nats), same length (0.0 at environment tokens)
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]  # weight versions over the model tokens; see VersionSpan
    text: str = ""  # detokenised completion (a trajectory: its turns' and environment steps' texts, joined)
    # Every token of a plain sample is the model's; a ``Trajectory`` overrides this with its mask. A class
    # attribute, not a field: the single-turn path builds millions of samples and pays nothing for it.
    loss_mask: ClassVar[tuple[int, ...] | None] = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"sample of {len(self.token_ids)} tokens has {len(self.logprobs)} log-probs")

    @property
    def num_model_tokens(self) -> int:
        """Tokens the model sampled (the ones the loss sees)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced a token of this sample."""
        return self.version_spans[0].version

    @property
    def newest_version(self) -> int:
        return self.version_spans[-1].version


@dataclass(frozen=True, slots=True)
class Trajectory(Sample):
    """A multi-turn episode as one flat sequence: the model's turns and the environment's tokens between them,
    in order, exactly as they were sampled and appended. A ``Sample``, so the queue, the wire and the learner take
    it as they take any other; spans cover its model tokens only (see ``VersionSpan``)."""

    # 1 for a model token (trained on), 0 for an environment token (in the context, never in the loss); same
    # length as ``token_ids``
    loss_mask: tuple[int, ...] = ()  # type: ignore[misc]  # a field here, the class attribute None on Sample

    def __post_init__(self) -> None:
        Sample.__post_init__(self)  # explicit: zero-argument super() breaks in slotted dataclasses
        if len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"trajectory of {len(self.token_ids)} tokens has a loss mask of {len(self.loss_mask)}")


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
    meta: Mapping[str, Any] = field(default_factory=dict)  # free-form metadata of the group's maker
    # Samples a maker attaches for the loss beside the rollouts, by role: XPO's reference completions under
    # ``"opponents"``, one per rollout. Never trained on as rollouts, so they count in neither staleness nor token
    # books; they travel on the wire.
    companions: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)

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
        """Model tokens over the group's rollouts (what the loss normalises by; environment tokens excluded)."""
        return sum(len(r.sample.token_ids) if r.sample.loss_mask is None else sum(r.sample.loss_mask)
                   for r in self.rollouts)


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
