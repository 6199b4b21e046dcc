"""Ready-made wiring for the common case: one engine, N producers sharing one group maker, a queue and a learner.

A trainer is a group maker plus a loss: GRPO is ``RewardGroups`` (or ``EpisodeGroups``, an ``AgentRunner``...) with
``GRPOLoss``; the preference trainers are ``JudgedGroups`` with their losses (``asyncrl.preference``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Iterable

import torch

from asyncrl.actors.learner import Learner
from asyncrl.actors.optimizer import StochasticAdamW
from asyncrl.actors.producer import Producer
from asyncrl.actors.training import TrainingBackend
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import GRPOLoss, Loss, LossConfig
from asyncrl.algorithms.reference import Reference
from asyncrl.config import ConfigError, LearnerConfig, PipelineConfig
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Engine, Sampler, WeightTarget
from asyncrl.groups.maker import GroupMaker
from asyncrl.metrics import Monitor
from asyncrl.pipeline import Pipeline
from asyncrl.queues.admission import OPEN, AdmissionGate
from asyncrl.queues.rollout_queue import create_rollout_queue
from asyncrl.types import Prompt
from asyncrl.versions import VersionClock

log = logging.getLogger(__name__)


def grpo_pipeline(engine: Engine, model: torch.nn.Module | None, prompts: Iterable[Prompt] | AsyncIterable[Prompt] |
                  PromptSource, groups: GroupMaker, config: PipelineConfig | None = None, *,
                  loss: Loss | None = None, loss_config: LossConfig | None = None, pad_id: int = 0,
                  ref_model: Reference | None = None, optimizer: torch.optim.Optimizer | None = None,
                  monitor: Monitor | None = None, step: int = 0, close_engine: bool = True,
                  backend: TrainingBackend | None = None, target: WeightTarget | None = None) -> Pipeline:
    """A ``Pipeline`` training ``model`` with GRPO (or ``loss``) on the groups ``groups`` makes from ``engine``'s
    samples: ``RewardGroups(reward_fn)`` for completions scored one by one, ``EpisodeGroups(env)`` for multi-turn
    episodes, an ``asyncrl.agents.AgentRunner`` for black-box agents, or a maker of your own
    (``asyncrl.groups.GroupMaker``).

    The version clock starts at the engine's version. ``step`` continues a run restored from a checkpoint;
    ``prompts`` may be a ``PromptSource`` already positioned at the checkpoint's cursor.

    With ``backend`` (e.g. ``asyncrl.distributed.FSDPBackend``) the learner trains through it, and ``model``,
    the loss arguments and ``optimizer`` must be left out: the backend owns them. ``target`` is what
    publications go to (default: ``engine``).
    """
    config = config or PipelineConfig()
    grpo_loss = (loss_config or LossConfig()) if loss is None and backend is None else None  # for a rollout log
    if backend is not None:
        _check_backend_alone(model, loss, loss_config, optimizer, ref_model)
        loss = backend.loss
    elif loss is None:
        # The loss scores at the sampling temperature and takes its token budget from it: set once, in sampling.
        loss = GRPOLoss(loss_config or LossConfig(), sampling=config.producer.sampling, pad_id=pad_id,
                        ref_model=ref_model)
    check_group_size(loss, config)
    check_engine_fits(engine, backend.model if backend is not None else model, config)
    source = prompts if isinstance(prompts, PromptSource) else PromptSource(prompts)
    clock = VersionClock(engine.version)
    gate = admission_gate(config, clock, step)
    sender, receiver = create_rollout_queue(config.queue, clock, gate=gate)
    with sender:  # each producer holds a clone; the queue ends when the last producer's closes
        producers = [Producer(engine, source, groups, sender.clone(), config.producer, name=f"producer-{i}",
                              admission=gate or OPEN) for i in range(config.num_producers)]
    sync = WeightSync(target or engine, clock, config.learner.sync)
    if backend is not None:
        learner = Learner(None, None, None, receiver, sync, config.learner, monitor=monitor, step=step,
                          backend=backend)
    else:
        optimizer = optimizer or default_optimizer(model, config.learner)
        learner = Learner(model, optimizer, loss, receiver, sync, config.learner, monitor=monitor, step=step)
    if config.rollout_log is not None:
        open_rollout_log(learner, config, grpo_loss, pad_id)
    return Pipeline(engine, producers, learner, config, close_engine=close_engine)


def open_rollout_log(learner: Learner, config: PipelineConfig, loss_config: LossConfig | None, pad_id: int) -> None:
    """Give ``learner`` a rollout log (``config.rollout_log``) whose header says how to rebuild its step:
    ``loss_config`` is that of the GRPO loss the recipe built (None: the caller's own loss, which a replay must be
    given). The queue's drops name their groups in it."""
    from asyncrl.rollout_log import RolloutLog, run_header  # pyarrow (the replay extra): needed with a log only

    assert config.rollout_log is not None
    dtype = next((str(p.dtype).removeprefix("torch.") for p in learner.model.parameters()), None)
    rollout_log = RolloutLog.open(config.rollout_log, run_header(config, loss_config, pad_id, dtype))
    learner.recorder = rollout_log
    learner.receiver.observe_drops(rollout_log.dropped)
    learner.hooks.append(lambda step, metrics: metrics.update(rollout_log.metrics()))


def admission_gate(config: PipelineConfig, clock: VersionClock, step: int = 0) -> AdmissionGate | None:
    """The pipeline's admission gate (``QueueConfig.admission``): the learner consumes ``batch_groups * every``
    groups per version, and a run resumed at ``step`` is that far into its publication cycle. Groups started and not
    yet trained are bounded by the queue's capacity plus every producer's in-flight slots."""
    if not config.queue.admission:
        return None
    learner = config.learner
    return AdmissionGate(clock, config.queue.max_staleness, learner.batch_groups * learner.sync.every,
                         offset=(step % learner.sync.every) * learner.batch_groups,
                         limit=config.queue.capacity + config.num_producers * config.producer.max_inflight_groups)


def _check_backend_alone(model: object, *owned_by_backend: object) -> None:
    if model is not None or any(x is not None for x in owned_by_backend):
        raise ConfigError("grpo_pipeline.backend", "the backend owns the model, loss and optimiser: pass "
                                                   "model=None and leave loss, loss_config, optimizer and "
                                                   "ref_model out")


def check_group_size(loss: Loss, config: PipelineConfig) -> None:
    """Refuse a group size the loss cannot learn from (GRPO with ``n=1``: every group would be inert)."""
    n = config.producer.sampling.n
    if n < loss.min_group_size:
        raise ConfigError("SamplingConfig.n", f"{type(loss).__name__} needs groups of at least "
                                              f"{loss.min_group_size} samples to learn anything, got n={n}")


def check_engine_fits(engine: Engine, model: torch.nn.Module | None, config: PipelineConfig) -> str | None:
    """Refuse what would otherwise pass silently: completions longer than the engine's context, and an engine
    sampling in another plain dtype than the learner computes in (after autocast) by accident. An engine that
    declares a quantization (``BehaviourPrecision.quantized``) differs on purpose: its pairing with the learner
    is accepted, logged at INFO and returned (``precision_pairing``), and the importance weights correct the gap."""
    max_tokens, context = config.producer.sampling.max_tokens, engine.max_model_len
    if max_tokens >= context:
        raise ConfigError("SamplingConfig.max_tokens", f"max_tokens={max_tokens} leaves no room for a prompt in "
                                                       f"{engine.name}'s context of {context} tokens (max_model_len)")
    precision, learner = engine.behaviour_precision, learner_dtype(model, config.learner)
    if precision is None or learner is None:
        return None
    if precision.dtype != learner and not precision.quantized and not config.allow_dtype_mismatch:
        raise ConfigError("PipelineConfig.allow_dtype_mismatch", (
            f"{engine.name} samples in {precision.dtype} but the learner computes in {learner}: the importance "
            f"ratios would measure that gap, not staleness. Start the engine in the learner's precision "
            f"(VLLMEngineConfig(dtype='{learner}')), or train in the engine's (LearnerConfig(autocast="
            f"'{precision.dtype}'), or the model loaded in {precision.dtype}); or accept the gap with "
            f"PipelineConfig(allow_dtype_mismatch=True)"))
    pairing = precision_pairing(engine, model, config.learner)
    if precision.dtype != learner or precision.quantized:
        log.info("precision: %s", pairing)
    return pairing


def precision_pairing(engine: Sampler, model: torch.nn.Module | None, config: LearnerConfig) -> str | None:
    """How the engine's behaviour precision pairs with the learner's, in words (None where either is unknown):
    what ``check_engine_fits`` logs and returns, for a run to report."""
    precision, learner = engine.behaviour_precision, learner_dtype(model, config)
    if precision is None or learner is None:
        return None
    if precision.dtype == learner and not precision.quantized:
        return f"{engine.name} samples in {learner}, as the learner computes"
    return (f"{engine.name} samples in {precision.describe()}, the learner computes in {learner}: the importance "
            f"weights correct the gap")


def learner_dtype(model: torch.nn.Module | None, config: LearnerConfig) -> str | None:
    """The precision the learner's forward pass computes in: its autocast dtype, else its parameters'."""
    if config.autocast is not None:
        return config.autocast
    floating = (p.dtype for p in model.parameters() if p.is_floating_point()) if model is not None else iter(())
    dtype = next(floating, None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def default_optimizer(model: torch.nn.Module, config: LearnerConfig) -> torch.optim.Optimizer:
    """The optimiser ``config.optimizer`` names, at the learner's ``lr`` and ``weight_decay``, over the parameters
    that require grad (all of them in full fine-tuning; the adapter's alone with LoRA, so the frozen base holds no
    optimiser state). "adamw": torch's AdamW, on a GPU its fused kernel, one launch per step for all parameters
    rather than a handful per parameter group and operation. "adamw_bf16": ``StochasticAdamW``, seeded from
    torch's seed (``torch.manual_seed``), so a seeded run reproduces its rounding too, and compiled when the
    learner compiles (``LearnerConfig.compiled``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameter that requires grad: nothing to train")
    if config.optimizer == "adamw_bf16":
        return StochasticAdamW(params, lr=config.lr, weight_decay=config.weight_decay, seed=torch.initial_seed(),
                               compiled=config.compiled)
    on_gpu = any(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=on_gpu)
