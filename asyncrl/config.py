"""Validated configuration (see ``asyncrl.config_base``): every field is checked at construction and documented
by its ``description``; errors name the field."""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Literal

from pydantic import Field, model_validator

from asyncrl.config_base import (
    Flag, NonNegativeFloat, NonNegativeInt, PathStr, PositiveFloat, PositiveInt, Seconds, config, describe, require,
)
from asyncrl.errors import ConfigError
from asyncrl.types import PauseMode

__all__ = ["AbortPolicy", "Autocast", "ConfigError", "EpisodeConfig", "InvalidGroupPolicy", "LearnerConfig",
           "PipelineConfig", "ProducerConfig", "QueueConfig", "RewardExecution", "RolloutLogConfig", "SamplingConfig",
           "SyncConfig", "describe"]


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


class Autocast(str, enum.Enum):
    """Mixed-precision dtype of the learner's forward/backward (the value is the ``torch`` dtype's name)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


TokenIds = Annotated[tuple[Annotated[int, Field(strict=True, ge=0)], ...], Field()]


@config
class SamplingConfig:
    """How each group is sampled."""

    n: Annotated[PositiveInt, Field(description="completions per prompt (the GRPO group size)")] = 8
    max_tokens: Annotated[PositiveInt, Field(
        description="completion length limit, in tokens; also the loss's per-sequence token budget")] = 16
    temperature: Annotated[PositiveFloat, Field(
        description="sampling temperature; the learner scores with the same one")] = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, description=(
        "nucleus sampling mass (1.0 = off; keep 1.0 for exact importance ratios)"))] = 1.0
    seed: Annotated[int | None, Field(strict=True, description=(
        "base seed for reproducible sampling; None = engine's randomness"))] = None
    ignore_eos: Annotated[Flag, Field(description=(
        "keep sampling past end-of-sequence (fixed-length runs in benchmarks and tests)"))] = False
    stop_token_ids: Annotated[TokenIds, Field(description=(
        "token ids that end a completion (finish reason ``stop``), kept as its last token: how a model's turn "
        "ends in an episode (a tool call's closing token, an end-of-turn token). Ids, not strings: no "
        "detokenising"))] = ()


@config
class EpisodeConfig:
    """Limits of a multi-turn episode (a producer given an environment). ``SamplingConfig.max_tokens`` limits
    each model turn; ``n`` is the number of episodes per group."""

    max_turns: Annotated[PositiveInt, Field(description=(
        "model turns at most; an episode still running after them ends as ``length``"))] = 4
    max_episode_tokens: Annotated[PositiveInt, Field(description=(
        "model and environment tokens after the prompt, at most (further capped by the engine's context). "
        "Each turn may sample only what is left; an episode with no room left ends as ``length``"))] = 512
    max_env_tokens: Annotated[PositiveInt, Field(description=(
        "ids one environment step may append. More drops the group (``env_output_too_long``): cutting them "
        "would leave the model a context the environment never wrote (half a chat template, half a tool "
        "result)"))] = 256
    env_timeout_s: Annotated[Seconds, Field(description=(
        "bound on every environment call (creation, step, close); over it: ``env_timeout``"))] = 30.0


@config
class ProducerConfig:
    """One producer actor."""

    sampling: Annotated[SamplingConfig, Field(description="how each group is sampled")] = Field(
        default_factory=SamplingConfig)
    max_inflight_groups: Annotated[PositiveInt, Field(description=(
        "groups being generated or scored at once by this producer"))] = 4
    on_abort: Annotated[AbortPolicy, Field(description=(
        "what happens to samples cut by an ``abort`` pause"))] = AbortPolicy.RESUBMIT
    on_invalid: Annotated[InvalidGroupPolicy, Field(description=(
        "what happens to bad prompts and to rewards that raise or are NaN"))] = InvalidGroupPolicy.DROP
    max_resubmits: Annotated[NonNegativeInt, Field(description=(
        "abort-cut samples are sampled again at most this many times, then dropped"))] = 3
    reward_timeout_s: Annotated[Seconds, Field(description=(
        "bound on every reward call (a group's samples, sync or async); a timed-out group is dropped and "
        "counted as ``reward_timeout``. A synchronous call that overruns keeps its thread until it "
        "returns"))] = 60.0
    sync_rewards: Annotated[RewardExecution, Field(description=(
        "where a synchronous reward function runs"))] = RewardExecution.THREAD
    reward_threads: Annotated[PositiveInt, Field(description=(
        "synchronous reward calls running at once (worker threads) per producer"))] = 4
    max_consecutive_drops: Annotated[PositiveInt, Field(description=(
        "a producer whose last this-many groups were all dropped as invalid (bad prompt or reward) stops the "
        "run with ``NoProgressError``: nothing trainable is coming"))] = 100
    episode: Annotated[EpisodeConfig, Field(description=(
        "episode limits, used only by a producer given an environment"))] = Field(default_factory=EpisodeConfig)


@config
class QueueConfig:
    """The bounded rollout queue between producers and learner."""

    capacity: Annotated[PositiveInt, Field(description=(
        "groups held at most; producers wait when it is full. With admission it is also how far producers run "
        "ahead of the learner: about one batch keeps both busy, more only makes every group staler"))] = 16
    # 2 (bench.cpu.learning, README "Staleness"): with admission and a queue of about one batch, the realized
    # staleness stays near 2 whatever the bound, and learning keeps up with synchronous training; a higher bound
    # lets long groups be trained instead of dropped. Groups trained at a bound of 4 or 8 need M2PO there.
    max_staleness: Annotated[NonNegativeInt, Field(description=(
        "groups more than this many versions old are dropped, not trained on"))] = 2
    admission: Annotated[Flag, Field(description=(
        "staleness-aware admission (``asyncrl.queues.admission``): a producer starts a group only if it can be "
        "trained within ``max_staleness``, and the learner takes groups in start order, so long groups are not "
        "dropped as stale and batches keep the policy's length distribution. False: start whenever there is room "
        "and train in finish order (stale groups dropped). Used by ``grpo_pipeline``"))] = True


@config
class SyncConfig:
    """How the learner publishes weights to the engine(s)."""

    every: Annotated[PositiveInt, Field(description="optimiser steps between weight publications")] = 1
    mode: Annotated[PauseMode, Field(description="pause mode used for every publication")] = PauseMode.KEEP
    clear_cache: Annotated[Flag, Field(description=(
        "reset the prefix/KV cache so no token reuses old-weight KV"))] = True
    overlap: Annotated[Flag, Field(description=(
        "publish in the background while the next step trains (from a snapshot of the weights, one extra "
        "copy); the learner waits only if the previous publication is still running when the next one is "
        "due"))] = False
    probe_tolerance: Annotated[float | None, Field(strict=True, gt=0, description=(
        "after each publication, score one trained sequence on the target and with the learner's published "
        "weights; a largest per-token log-prob difference above this fails the run (``actors.probe``): an engine "
        "that kept other weights, or an adapter that never reached it, is caught at once. ~1e-3 where both "
        "compute in float32, a few hundredths in bfloat16. None: no probe"))] = None
    probe_tokens: Annotated[PositiveInt, Field(description=(
        "longest probe sequence (the first prompt and completion of the last batch, cut to this)"))] = 64


@config
class LearnerConfig:
    """The learner actor."""

    batch_groups: Annotated[PositiveInt, Field(description="rollout groups per optimiser step")] = 4
    lr: Annotated[PositiveFloat, Field(description="AdamW learning rate")] = 1e-5
    weight_decay: Annotated[NonNegativeFloat, Field(description="AdamW weight decay")] = 0.0
    optimizer: Annotated[Literal["adamw", "adamw_bf16"], Field(description=(
        "what ``asyncrl.recipes.default_optimizer`` builds. \"adamw\": torch's AdamW (fused on a GPU); over "
        "bfloat16 weights it loses every update below half a bfloat16 spacing. \"adamw_bf16\": AdamW with states in "
        "the parameters' dtype and stochastic rounding, for bf16 weights (``asyncrl.actors.optimizer."
        "StochasticAdamW``): 8 bytes a parameter with its gradient, and updates far below a spacing (lr 1e-6) still "
        "move the weights on average. Float32 parameters get the exact update with either"))] = "adamw"
    max_grad_norm: Annotated[float, Field(strict=True, description="gradient clipping (<= 0 disables)")] = 1.0
    micro_batch_rollouts: Annotated[PositiveInt, Field(description=(
        "rollouts per forward/backward pass (memory bound)"))] = 64
    micro_batch_tokens: Annotated[PositiveInt | None, Field(description=(
        "forward tokens (prompt + completion, over every rollout) per forward/backward pass instead of a "
        "rollout count: memory follows tokens, so long and short batches both fill the pass. Whole groups stay "
        "together, so a group over the limit runs alone. None = count rollouts (``micro_batch_rollouts``)"))] = None
    packing: Annotated[Flag, Field(description=(
        "pack several sequences into each input row (positions restart per sequence, attention kept within "
        "each) instead of right-padding every sequence to the longest: the same log-probs and step (up to float "
        "rounding) without computing padding. Worth it when lengths vary a lot within a micro-batch; needs a "
        "model whose attention honours restarting ``position_ids`` without a mask (transformers' decoders "
        "do)"))] = False
    varlen_attention: Annotated[Flag, Field(description=(
        "with packing: attend through a variable-length kernel (``asyncrl.algorithms.varlen``; flash on a GPU) "
        "instead of sdpa with a block-diagonal mask, so each sequence costs its own length squared and a "
        "micro-batch is one row with no padding. The learner switches the model's attention implementation; a "
        "transformers Llama, Mistral or Qwen decoder without sliding windows"))] = False
    score_from_logits: Annotated[Flag, Field(description=(
        "score from ``model(...).logits`` even for a decoder whose last hidden states the learner could score "
        "chunk by chunk (``asyncrl.algorithms.head``): for a model whose forward does more than its head shows, "
        "or to compare with a sharded model, which is always scored from its logits"))] = False
    compile_elementwise: Annotated[Flag, Field(description=(
        "``torch.compile`` (dynamic shapes) the memory-bound element-wise chains: each MLP and RMSNorm module "
        "of a transformers decoder (SiLU times the up projection; the float32 norm) and the log-prob head's "
        "per-chunk softmax, forward and backward, so each runs as one fused kernel. Costs a compile on the "
        "first steps"))] = False
    compile_layers: Annotated[Flag, Field(description=(
        "``torch.compile`` (dynamic shapes) each decoder layer whole instead, plus the final norm and the same "
        "log-prob head: besides the chains above, rotary embeddings, casts and residual adds fuse too, and a "
        "layer is one compiled call rather than dozens of eager launches (the host stops lagging the device). "
        "Meant with ``varlen_attention``, whose flash kernel compiles in the graph; the CPU reference splits "
        "it"))] = False
    gradient_checkpointing: Annotated[Flag, Field(description=(
        "recompute each transformer block's activations in the backward pass instead of keeping them (the "
        "model's ``gradient_checkpointing_enable()``): much less activation memory for about a third more "
        "compute, so larger micro-batches fit. The step is the same"))] = False
    memory_budget_gib: Annotated[PositiveFloat | None, Field(description=(
        "device memory one learner step may hold, in GiB (``asyncrl.actors.memory``): each pass is sized by the "
        "plan's prediction of its peak (weights, gradients, optimiser states, activations, attention masks, the "
        "log-prob head) instead of by ``micro_batch_rollouts``; ``micro_batch_tokens``, if set, caps passes "
        "further. Gradient checkpointing is turned on (and left on) the first time a group needs it to fit. A "
        "group that fits no pass fails its step before the first forward (``MemoryBudgetError``, naming the group, "
        "its tokens and the budget); a budget below the static bytes fails construction. Steps report "
        "``learner/memory_predicted_gib`` and, on a GPU, ``learner/memory_peak_gib``. Per rank for a sharded "
        "learner. None = sized by the counts alone"))] = None
    skip_inert_groups: Annotated[Flag, Field(description=(
        "skip the forward/backward of groups the loss proves contribute no gradient (GRPO groups whose rewards "
        "are all equal, without KL or entropy terms). The update is the same; their tokens still count in the "
        "normaliser, and they are counted as trained"))] = True
    autocast: Annotated[Autocast | None, Field(description=(
        "mixed precision for the forward/backward (None = the model's dtype). Weights, gradients and the "
        "optimiser stay in the model's dtype; log-probs are normalised in float32"))] = None
    nice: Annotated[int, Field(strict=True, ge=0, le=19, description=(
        "niceness added to the learner's training thread (Linux; 0-19). On a CPU host where training shares "
        "cores with vLLM, > 0 lets the engine's processes and the event loop preempt it, so generation keeps "
        "its pace and training runs on what is left (bench/cpu/contention.py: generation 0.77 -> 0.85 of its solo "
        "speed at 19). Torch's intra-op worker threads are not the training thread: use 1 torch thread for it "
        "to cover the step"))] = 0
    stall_timeout_s: Annotated[float, Field(strict=True, gt=0, description=(
        "a learner that waits this long for a batch fails with ``NoProgressError`` naming what it saw (drops "
        "by reason, queue depth); ``math.inf`` waits forever"))] = 600.0
    sync: Annotated[SyncConfig, Field(description="how weights are published")] = Field(
        default_factory=SyncConfig)

    @model_validator(mode="after")
    def _rules(self) -> LearnerConfig:
        require(self.packing or not self.varlen_attention, self, "varlen_attention",
                "needs packing=True (it attends within packed rows)")
        require(not (self.compile_layers and self.compile_elementwise), self, "compile_layers",
                "compiles the element-wise chains inside each layer already: set it or compile_elementwise, not both")
        require(self.nice == 0 or sys.platform.startswith("linux"), self, "nice",
                f"needs Linux (per-thread niceness), this is {sys.platform}")
        return self

    @property
    def compiled(self) -> bool:
        """Whether anything is compiled: either option compiles the log-prob head's chunk maths, and
        ``adamw_bf16``'s update."""
        return self.compile_elementwise or self.compile_layers


@config
class RolloutLogConfig:
    """The rollout log (``asyncrl.rollout_log``): every trained batch on disk, for replay and inspection."""

    dir: Annotated[PathStr, Field(description=(
        "directory of the log's Arrow IPC stream files; one writing run at a time (a resumed run continues it, its "
        "steps replacing those an earlier run logged from the same step on)"))]
    steps_per_file: Annotated[PositiveInt, Field(description=(
        "steps per file before the next file starts (files also start when one would pass max_bytes / 4)"))] = 100
    max_bytes: Annotated[int, Field(strict=True, ge=64 * 1024, description=(
        "bound on the log's size on disk, bytes: the oldest files are deleted to stay under it, so a replay can "
        "only start where the log still begins; a single step over max_bytes / 4 fails the run"))] = 4 << 30
    max_pending_steps: Annotated[PositiveInt, Field(description=(
        "steps handed to the writer thread and not yet written; the learner waits (backpressure) beyond "
        "that"))] = 4
    model_dir: Annotated[PathStr | None, Field(description=(
        "the Hugging Face model directory the run started from, recorded in the log's header so that "
        "``asyncrl replay`` can rebuild the model without --model (None: the command needs --model)"))] = None


@config
class PipelineConfig:
    """The whole pipeline. Cross-field rules are checked here."""

    producer: Annotated[ProducerConfig, Field(description="each producer actor")] = Field(
        default_factory=ProducerConfig)
    queue: Annotated[QueueConfig, Field(description="the rollout queue")] = Field(default_factory=QueueConfig)
    learner: Annotated[LearnerConfig, Field(description="the learner actor")] = Field(default_factory=LearnerConfig)
    num_producers: Annotated[PositiveInt, Field(description="producer actors sharing the engine(s)")] = 1
    shutdown_timeout_s: Annotated[Seconds, Field(description=(
        "bound on each shutdown step (learner thread, engine) after the run ends"))] = 30.0
    progress: Annotated[bool, Field(description=(
        "print one short line per learner step to stderr (step, version, groups, reward, staleness, tokens/s, "
        "drops; ``asyncrl.metrics.ProgressLine``); off for programs that print their own"))] = True
    allow_dtype_mismatch: Annotated[bool, Field(description=(
        "train although the engine samples in another precision than the learner computes in (refused by "
        "default: the importance ratios would measure the precision gap, not staleness)"))] = False
    rollout_log: Annotated[RolloutLogConfig | None, Field(description=(
        "write every trained batch to a rollout log (``asyncrl.rollout_log``; needs pyarrow, the ``replay`` "
        "extra) so the learner can be replayed from a checkpoint (``asyncrl.replay``); None: no log"))] = None

    @model_validator(mode="after")
    def _rules(self) -> PipelineConfig:
        require(self.learner.batch_groups <= self.queue.capacity, self, "learner.batch_groups",
                f"a batch of {self.learner.batch_groups} groups cannot fit a queue of capacity "
                f"{self.queue.capacity} (QueueConfig.capacity)")
        return self
