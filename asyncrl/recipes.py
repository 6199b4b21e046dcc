"""Ready-made wiring for the common case: one engine, N producers, a queue and a GRPO learner."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import torch

from asyncrl.actors.learner import Learner
from asyncrl.actors.producer import Producer
from asyncrl.actors.rewards import RewardFn
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import GRPOLoss, Loss, LossConfig
from asyncrl.config import ConfigError, PipelineConfig
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Engine
from asyncrl.episodes.types import EnvFactory
from asyncrl.metrics import Monitor
from asyncrl.pipeline import Pipeline
from asyncrl.queues.rollout_queue import create_rollout_queue
from asyncrl.types import Prompt
from asyncrl.versions import VersionClock


def grpo_pipeline(engine: Engine, model: torch.nn.Module, prompts: Iterable[Prompt] | AsyncIterable[Prompt] |
                  PromptSource, reward_fn: RewardFn | None, config: PipelineConfig | None = None, *,
                  loss: Loss | None = None, loss_config: LossConfig | None = None, pad_id: int = 0,
                  ref_model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                  monitor: Monitor | None = None, step: int = 0, close_engine: bool = True,
                  env: EnvFactory | None = None) -> Pipeline:
    """A ``Pipeline`` training ``model`` with GRPO (or ``loss``) on groups sampled from ``engine``.

    The version clock starts at the engine's version. ``step`` continues a run restored from a checkpoint;
    ``prompts`` may be a ``PromptSource`` already positioned at the checkpoint's cursor. With ``env`` every
    group is ``n`` multi-turn episodes (``asyncrl.episodes``), rewarded by the environment plus ``reward_fn``
    over the whole trajectory if one is given.
    """
    config = config or PipelineConfig()
    if loss is None:
        cfg = loss_config or LossConfig(temperature=config.producer.sampling.temperature)
        loss = GRPOLoss(cfg, pad_id=pad_id, ref_model=ref_model)
    check_group_size(loss, config)
    source = prompts if isinstance(prompts, PromptSource) else PromptSource(prompts)
    clock = VersionClock(engine.version)
    sender, receiver = create_rollout_queue(config.queue, clock)
    with sender:  # each producer holds a clone; the queue ends when the last producer's closes
        producers = [Producer(engine, source, reward_fn, sender.clone(), config.producer,
                              group_counters=receiver.counters, name=f"producer-{i}", env=env)
                     for i in range(config.num_producers)]
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=config.learner.lr,
                                               weight_decay=config.learner.weight_decay)
    learner = Learner(model, optimizer, loss, receiver, WeightSync(engine, clock, config.learner.sync),
                      config.learner, monitor=monitor, step=step)
    return Pipeline(engine, producers, learner, config, close_engine=close_engine)


def check_group_size(loss: Loss, config: PipelineConfig) -> None:
    """Refuse a group size the loss cannot learn from (GRPO with ``n=1``: every group would be inert)."""
    n = config.producer.sampling.n
    if n < loss.min_group_size:
        raise ConfigError("SamplingConfig.n", f"{type(loss).__name__} needs groups of at least "
                                              f"{loss.min_group_size} samples to learn anything, got n={n}")
