"""Checkpoints of a running pipeline, and a pipeline resumed from one: the thin layer between the store and
the actors.

Typical use (a fresh run and a resumed one are the same code)::

    async with Checkpointer(CheckpointConfig(dir="runs/x/ckpt", every_steps=50)) as ckpt:
        pipe, state = await resume_pipeline(engine, model, items, RewardGroups(reward_fn), config,
                                            checkpoint=latest("runs/x/ckpt"), checkpointer=ckpt)
        await pipe.run(steps)

Data semantics: the cursor counts prompts handed out when the checkpoint was taken. Groups still queued or
being generated then are not replayed: on resume the source continues at the cursor and those groups are
counted as dropped (``unused_at_shutdown``), so the restored accounting still balances.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.learner import Learner, StepHook
from asyncrl.groups.maker import GroupMaker
from asyncrl.checkpoint.store import Checkpoint, Checkpointer, ResumeState, TrainingState, restore, verify
from asyncrl.config import PipelineConfig
from asyncrl.counters import GroupTotals
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Engine
from asyncrl.pipeline import Pipeline
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import Prompt

log = logging.getLogger(__name__)


def training_state(learner: Learner, source: PromptSource, extra: Mapping[str, Any] | None = None) -> TrainingState:
    """Where ``learner`` stands now. Call with no publication in flight (``await learner.flush()``), so that
    ``version`` and ``published`` are exact."""
    counters = learner.totals()
    return TrainingState(
        step=learner.step, version=learner.version, published=learner.step % learner.config.sync.every == 0,
        cursor=source.cursor, counters=counters, queue_depth=learner.receiver.depth,
        # Prompts handed out that are neither queued nor dropped yet: groups being generated.
        in_flight=max(0, source.cursor - counters.queued - counters.dropped_before_queue),
        extra=dict(extra or {}))


async def save_learner(checkpointer: Checkpointer, learner: Learner, source: PromptSource,
                       extra: Mapping[str, Any] | None = None) -> Checkpoint:
    """Checkpoint ``learner`` now (after its background publication has landed) and wait for the files."""
    await learner.flush()
    return await checkpointer.save(learner.model, learner.optimizer, training_state(learner, source, extra))


def checkpoint_hook(checkpointer: Checkpointer, learner: Learner, source: PromptSource) -> StepHook:
    """A learner hook that checkpoints every ``every_steps`` steps (writing in the background) and adds
    ``checkpoint/*`` gauges to each step's metrics. With ``SyncConfig(overlap=True)`` a checkpoint step first
    waits for the publication in flight, so the version it records is exact."""
    every = checkpointer.config.every_steps
    if every % learner.config.sync.every:
        log.warning("checkpoints every %d steps fall between weight syncs (every %d): a resumed run publishes "
                    "its weights as a new version", every, learner.config.sync.every)

    async def hook(step: int, metrics: dict[str, float]) -> None:
        if step % every == 0:
            await learner.flush()
            await checkpointer.start_save(learner.model, learner.optimizer, training_state(learner, source))
        metrics.update(checkpointer.metrics())

    return hook


async def resume_pipeline(engine: Engine, model: torch.nn.Module,
                          items: Iterable[Prompt] | AsyncIterable[Prompt] | PromptSource,
                          groups: GroupMaker, config: PipelineConfig | None = None, *,
                          checkpoint: Checkpoint | str | Path | None, checkpointer: Checkpointer | None = None,
                          **kwargs: Any) -> tuple[Pipeline, ResumeState | None]:
    """A ``grpo_pipeline`` continuing from ``checkpoint`` (None: a fresh run), ready to ``run()``.

    ``items`` is the full prompt stream, as given to the original run, or a fresh ``PromptSource`` built as the
    original run's was (its epochs and shuffle seed); either is positioned at the checkpoint's cursor. Weights
    and optimiser state are restored into ``model`` and the pipeline's optimiser, the group
    accounting continues, and the restored weights are published to ``engine`` under the checkpoint's version
    (the next one if they were saved between publications). With ``checkpointer``, the pipeline checkpoints
    itself every ``every_steps`` steps. ``groups`` and ``kwargs`` go to ``grpo_pipeline``.
    """
    ckpt = verify(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
    meta = ckpt.meta if ckpt else {"cursor": 0, "step": 0}
    if isinstance(items, PromptSource):
        source = items
        source.seek(meta["cursor"])
    else:
        source = PromptSource(items, start=meta["cursor"])
    pipe = grpo_pipeline(engine, model, source, groups, config, step=meta["step"], **kwargs)
    state = None
    if ckpt is not None:
        state = restore(ckpt, pipe.learner.model, pipe.learner.optimizer)
        continue_books(pipe, state.counters)
        version = state.version if state.published else state.version + 1
        served = pipe.learner.version
        if version <= served:  # an engine that already moved past it: versions never go back
            log.warning("engine %s serves version %d; the restored weights (version %d) are published as %d",
                        engine.name, served, version, served + 1)
            version = served + 1
        await pipe.learner.publish(version)
    if checkpointer is not None:
        pipe.learner.hooks.append(checkpoint_hook(checkpointer, pipe.learner, source))
    return pipe, state


def continue_books(pipe: Pipeline, saved: GroupTotals) -> None:
    """Carry a checkpoint's totals (``store.restored_counters``) into a new pipeline: its books count this
    process's groups, and its totals add the saved ones."""
    pipe.learner.books.carry(saved)
