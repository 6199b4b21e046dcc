"""Ready-made wiring for the common case: one engine, N producers, a queue and a GRPO learner."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import torch

from asyncrl.actors.learner import Learner
from asyncrl.actors.producer import Producer, RewardFn
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import GRPOLoss, Loss, LossConfig
from asyncrl.config import PipelineConfig
from asyncrl.data import PromptSource
from asyncrl.engines.base import Engine
from asyncrl.metrics import Monitor
from asyncrl.pipeline import Pipeline
from asyncrl.queues.rollout_queue import RolloutQueue
from asyncrl.types import Prompt


def grpo_pipeline(engine: Engine, model: torch.nn.Module, prompts: Iterable[Prompt] | AsyncIterable[Prompt] |
                  PromptSource, reward_fn: RewardFn, config: PipelineConfig | None = None, *,
                  loss: Loss | None = None, loss_config: LossConfig | None = None, pad_id: int = 0,
                  ref_model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                  monitor: Monitor | None = None, version: int = 0, step: int = 0,
                  close_engine: bool = True) -> Pipeline:
    """A ``Pipeline`` training ``model`` with GRPO (or ``loss``) on groups sampled from ``engine``.

    ``version`` and ``step`` continue a run restored from a checkpoint; ``prompts`` may be a
    ``PromptSource`` already positioned at the checkpoint's cursor.
    """
    config = config or PipelineConfig()
    source = prompts if isinstance(prompts, PromptSource) else PromptSource(prompts)
    queue = RolloutQueue(config.queue)
    producers = [
        Producer(engine, source, reward_fn, queue, config.producer, ledger=queue.ledger, name=f"producer-{i}")
        for i in range(config.num_producers)
    ]
    if loss is None:
        cfg = loss_config or LossConfig(temperature=config.producer.sampling.temperature)
        loss = GRPOLoss(cfg, pad_id=pad_id, ref_model=ref_model)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=config.learner.lr,
                                               weight_decay=config.learner.weight_decay)
    learner = Learner(model, optimizer, loss, queue, WeightSync(engine, config.learner.sync), config.learner,
                      monitor=monitor, version=version, step=step)
    return Pipeline(engine, producers, queue, learner, config, close_engine=close_engine)
