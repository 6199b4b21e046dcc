"""Validated configuration. Every field is checked at construction; errors name the field."""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass, field, fields

from asyncrl.errors import ConfigError
from asyncrl.types import PauseMode

__all__ = ["AbortPolicy", "ConfigError", "EpisodeConfig", "InvalidGroupPolicy", "LearnerConfig", "PipelineConfig",
           "ProducerConfig", "QueueConfig", "RewardExecution", "SamplingConfig", "SyncConfig", "describe"]


def _require(ok: bool, owner: object, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{type(owner).__name__}.{name}", message)


def _positive_ints(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            obj, name, f"must be a positive integer, got {value!r}",
        )


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _coerce_enum(obj: object, name: str, enum_cls: type[enum.Enum]) -> None:
    value = getattr(obj, name)
    try:
        object.__setattr__(obj, name, enum_cls(value))
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ConfigError(f"{type(obj).__name__}.{name}", f"must be one of {allowed}, got {value!r}") from None


class AbortPolicy(str, enum.Enum):
    """What the producer does with samples cut by an ``abort`` pause."""

    RESUBMIT = "resubmit"  # sample them again under the new weights; the group is kept
    DROP = "drop"  # drop the whole group, counted as ``DropReason.ABORTED``


class RewardExecution(str, enum.Enum):
    """Where a synchronous reward function runs (an ``async`` one always runs on the event loop)."""

    THREAD = "thread"  # in a worker thread, so a slow reward never stalls the event loop
    INLINE = "inline"  # on the event loop: only for rewards that take microseconds (no thread hop per group)


class InvalidGroupPolicy(str, enum.Enum):
    """What happens to a group whose prompt or reward is invalid."""

    DROP = "drop"  # drop it with a counted reason and carry on
    FAIL = "fail"  # stop the run with an error naming the group


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How each group is sampled."""

    n: int = 8  # completions per prompt (the GRPO group size)
    max_tokens: int = 16  # completion length limit, in tokens
    temperature: float = 1.0  # sampling temperature; the learner scores with the same one
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off; keep 1.0 for exact importance ratios)
    seed: int | None = None  # base seed for reproducible sampling; None = engine's randomness
    ignore_eos: bool = False  # keep sampling past end-of-sequence (fixed-length runs in benchmarks and tests)
    # Token ids that end a completion (finish reason ``stop``), kept as its last token: how a model's turn
    # ends in an episode (a tool call's closing token, an end-of-turn token). Ids, not strings: no detokenising.
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _positive_ints(self, "n", "max_tokens")
        ids = self.stop_token_ids
        _require(isinstance(ids, tuple | list) and all(type(t) is int and t >= 0 for t in ids), self,
                 "stop_token_ids", f"must be a tuple of token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        _require(math.isfinite(self.temperature) and self.temperature > 0, self, "temperature",
                 f"must be > 0, got {self.temperature!r}")
        _require(0 < self.top_p <= 1, self, "top_p", f"must be in (0, 1], got {self.top_p!r}")


@dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """Limits of a multi-turn episode (a producer given an environment). ``SamplingConfig.max_tokens`` limits
    each model turn; ``n`` is the number of episodes per group."""

    max_turns: int = 4  # model turns at most; an episode still running after them ends as ``length``
    # Model and environment tokens after the prompt, at most (further capped by the engine's context). Each
    # turn may sample only what is left; an episode with no room left ends as ``length``.
    max_episode_tokens: int = 512
    # Ids one environment step may append. More drops the group (``env_output_too_long``): cutting them would
    # leave the model a context the environment never wrote (half a chat template, half a tool result).
    max_env_tokens: int = 256
    env_timeout_s: float = 30.0  # bound on every environment call (creation, step, close); over it: ``env_timeout``

    def __post_init__(self) -> None:
        _positive_ints(self, "max_turns", "max_episode_tokens", "max_env_tokens")
        _require(_positive_number(self.env_timeout_s), self, "env_timeout_s",
                 f"must be a positive number of seconds, got {self.env_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """One producer actor."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_inflight_groups: int = 4  # groups being generated or scored at once by this producer
    on_abort: AbortPolicy = AbortPolicy.RESUBMIT
    on_invalid: InvalidGroupPolicy = InvalidGroupPolicy.DROP  # bad prompts, rewards that raise or are NaN
    max_resubmits: int = 3  # abort-cut samples are sampled again at most this many times, then dropped
    # Every reward call (a group's samples, sync or async) is bounded by this; a timed-out group is dropped and
    # counted as ``reward_timeout``. A synchronous call that overruns keeps its thread until it returns.
    reward_timeout_s: float = 60.0
    sync_rewards: RewardExecution = RewardExecution.THREAD
    reward_threads: int = 4  # synchronous reward calls running at once (worker threads) per producer
    # A producer whose last this-many groups were all dropped as invalid (bad prompt or reward) stops the run
    # with ``NoProgressError``: nothing trainable is coming.
    max_consecutive_drops: int = 100
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)  # used only by a producer given an environment

    def __post_init__(self) -> None:
        _positive_ints(self, "max_inflight_groups", "reward_threads", "max_consecutive_drops")
        _coerce_enum(self, "on_abort", AbortPolicy)
        _coerce_enum(self, "on_invalid", InvalidGroupPolicy)
        _coerce_enum(self, "sync_rewards", RewardExecution)
        _require(_positive_number(self.reward_timeout_s), self, "reward_timeout_s",
                 f"must be a positive number of seconds, got {self.reward_timeout_s!r}")
        _require(isinstance(self.max_resubmits, int) and self.max_resubmits >= 0, self, "max_resubmits",
                 f"must be a non-negative integer, got {self.max_resubmits!r}")


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The bounded rollout queue between producers and learner."""

    capacity: int = 16  # groups held at most; producers wait when it is full
    # Groups more than this many versions old are dropped, not trained on. 2: at 1, a producer whose group
    # spans a publication often lands a group that is already too old, and the drops cost more wall time than
    # the overlap saves (bench/learning.py: async at 2 beats sync in wall time at equal accuracy; at 1 it
    # does not); at 4 accuracy suffers even with the importance-weight correction.
    max_staleness: int = 2
    # Staleness-aware admission (``asyncrl.queues.admission``): a producer starts a group only if it can be trained
    # within ``max_staleness``, and the learner takes groups in start order, so long groups are not dropped as
    # stale and batches keep the policy's length distribution. False: start whenever there is room and train in
    # finish order (stale groups dropped). Used by ``grpo_pipeline``.
    admission: bool = True

    def __post_init__(self) -> None:
        _positive_ints(self, "capacity")
        _require(isinstance(self.admission, bool), self, "admission", f"must be a bool, got {self.admission!r}")
        _require(isinstance(self.max_staleness, int) and self.max_staleness >= 0, self, "max_staleness",
                 f"must be a non-negative integer, got {self.max_staleness!r}")


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """How the learner publishes weights to the engine(s)."""

    every: int = 1  # optimiser steps between weight publications
    mode: PauseMode = PauseMode.KEEP  # pause mode used for every publication
    clear_cache: bool = True  # reset the prefix/KV cache so no token reuses old-weight KV
    # Publish in the background while the next step trains (from a snapshot of the weights, one extra copy);
    # the learner waits only if the previous publication is still running when the next one is due.
    overlap: bool = False

    def __post_init__(self) -> None:
        _positive_ints(self, "every")
        _require(isinstance(self.overlap, bool), self, "overlap", "must be a bool")
        _coerce_enum(self, "mode", PauseMode)
        _require(isinstance(self.clear_cache, bool), self, "clear_cache", "must be a bool")


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """The learner actor."""

    batch_groups: int = 4  # rollout groups per optimiser step
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # gradient clipping (<= 0 disables)
    micro_batch_rollouts: int = 64  # rollouts per forward/backward pass (memory bound)
    # Forward tokens (prompt + completion, over every rollout) per forward/backward pass instead of a rollout
    # count: memory follows tokens, so long and short batches both fill the pass. Whole groups stay together,
    # so a group over the limit runs alone. None = count rollouts (``micro_batch_rollouts``).
    micro_batch_tokens: int | None = None
    # Pack several sequences into each input row (positions restart per sequence, attention kept within each)
    # instead of right-padding every sequence to the longest: the same log-probs and step (up to float
    # rounding) without computing padding. Worth it when lengths vary a lot within a micro-batch; needs a model
    # whose attention honours restarting ``position_ids`` without a mask (transformers' decoders do).
    packing: bool = False
    # With packing: attend through a variable-length kernel (``asyncrl.algorithms.varlen``; flash on a GPU)
    # instead of sdpa with a block-diagonal mask, so each sequence costs its own length squared and a
    # micro-batch is one row with no padding. The learner switches the model's attention implementation; a
    # transformers Llama, Mistral or Qwen decoder without sliding windows.
    varlen_attention: bool = False
    # ``torch.compile`` (dynamic shapes) the memory-bound element-wise chains: each MLP and RMSNorm module of a
    # transformers decoder (SiLU times the up projection; the float32 norm) and the log-prob head's per-chunk
    # softmax, forward and backward, so each runs as one fused kernel. Costs a compile on the first steps.
    compile_elementwise: bool = False
    # ``torch.compile`` (dynamic shapes) each decoder layer whole instead, plus the final norm and the same
    # log-prob head: besides the chains above, rotary embeddings, casts and residual adds fuse too, and a layer
    # is one compiled call rather than dozens of eager launches (the host stops lagging the device). Meant
    # with ``varlen_attention``, whose flash kernel compiles in the graph; the CPU reference splits it.
    compile_layers: bool = False
    # Recompute each transformer block's activations in the backward pass instead of keeping them (the model's
    # ``gradient_checkpointing_enable()``): much less activation memory for about a third more compute, so
    # larger micro-batches fit. The step is the same.
    gradient_checkpointing: bool = False
    # Skip the forward/backward of groups the loss proves contribute no gradient (GRPO groups whose rewards
    # are all equal, without KL or entropy terms). The update is the same; their tokens still count in the
    # normaliser, and they are counted as trained.
    skip_inert_groups: bool = True
    # Mixed precision for the forward/backward ("bfloat16" or "float16" autocast; None = the model's dtype).
    # Weights, gradients and the optimiser stay in the model's dtype; log-probs are normalised in float32.
    autocast: str | None = None
    # Niceness added to the learner's training thread (Linux; 0-19). On a CPU host where training shares cores
    # with vLLM, > 0 lets the engine's processes and the event loop preempt it, so generation keeps its pace
    # and training runs on what is left (bench/contention.py: generation 0.77 -> 0.85 of its solo speed at 19).
    # Torch's intra-op worker threads are not the training thread: use 1 torch thread for it to cover the step.
    nice: int = 0
    # A learner that waits this long for a batch fails with ``NoProgressError`` naming what it saw (drops by
    # reason, queue depth); ``math.inf`` waits forever.
    stall_timeout_s: float = 600.0
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self) -> None:
        _positive_ints(self, "batch_groups", "micro_batch_rollouts")
        tokens = self.micro_batch_tokens
        _require(tokens is None or (type(tokens) is int and tokens > 0), self, "micro_batch_tokens",
                 f"must be None (count rollouts) or a positive integer, got {tokens!r}")
        for name in ("packing", "varlen_attention", "compile_elementwise", "compile_layers", "gradient_checkpointing"):
            _require(isinstance(getattr(self, name), bool), self, name, f"must be a bool, got {getattr(self, name)!r}")
        _require(self.packing or not self.varlen_attention, self, "varlen_attention",
                 "needs packing=True (it attends within packed rows)")
        _require(not (self.compile_layers and self.compile_elementwise), self, "compile_layers",
                 "compiles the element-wise chains inside each layer already: set it or compile_elementwise, not both")
        _require(type(self.nice) is int and 0 <= self.nice <= 19, self, "nice",
                 f"must be an integer in 0..19, got {self.nice!r}")
        _require(self.nice == 0 or sys.platform.startswith("linux"), self, "nice",
                 f"needs Linux (per-thread niceness), this is {sys.platform}")
        _require(self.autocast in (None, "bfloat16", "float16"), self, "autocast",
                 f"must be None, 'bfloat16' or 'float16', got {self.autocast!r}")
        _require(math.isfinite(self.lr) and self.lr > 0, self, "lr", f"must be > 0, got {self.lr!r}")
        _require(self.weight_decay >= 0, self, "weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        _require(isinstance(self.stall_timeout_s, int | float) and self.stall_timeout_s > 0, self,
                 "stall_timeout_s", f"must be > 0 (math.inf: no limit), got {self.stall_timeout_s!r}")

    @property
    def compiled(self) -> bool:
        """Whether anything is compiled: either option compiles the log-prob head's chunk maths."""
        return self.compile_elementwise or self.compile_layers


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """The whole pipeline. Cross-field rules are checked here."""

    producer: ProducerConfig = field(default_factory=ProducerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    num_producers: int = 1  # producer actors sharing the engine(s)
    shutdown_timeout_s: float = 30.0  # bound on each shutdown step (learner thread, engine) after the run ends

    def __post_init__(self) -> None:
        _positive_ints(self, "num_producers")
        _require(_positive_number(self.shutdown_timeout_s), self, "shutdown_timeout_s", "must be > 0")
        _require(
            self.learner.batch_groups <= self.queue.capacity, self, "learner.batch_groups",
            f"a batch of {self.learner.batch_groups} groups cannot fit a queue of capacity "
            f"{self.queue.capacity} (QueueConfig.capacity)",
        )


def describe(obj: object) -> dict[str, object]:
    """A JSON-friendly dict of a config tree, for logs and result files."""
    out: dict[str, object] = {}
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if hasattr(value, "__dataclass_fields__"):
            out[f.name] = describe(value)
        elif isinstance(value, enum.Enum):
            out[f.name] = value.value
        else:
            out[f.name] = value
    return out
