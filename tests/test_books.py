"""Each component keeps its own books (producer, queue, learner), written by it alone, and the totals that
``RunResult``, checkpoints and the ``groups/*`` metrics report are their sum (FakeEngine: fast)."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from asyncrl import (
    DropReason, LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig, SyncConfig,
    VersionClock, grpo_pipeline,
)
from asyncrl.counters import GroupTotals
from asyncrl.queues import create_rollout_queue
from asyncrl.actors.learner import Learner, LearnerCounters
from asyncrl.actors.producer import ProducerCounters
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import Loss, LossOutput
from asyncrl.checkpoint import TrainingState, latest, restore, resume_pipeline
from asyncrl.checkpoint.store import restored_counters, state_meta
from asyncrl.counters import Drops, add_up
from asyncrl.engines.fake import FakeEngine
from asyncrl.queues.rollout_queue import QueueCounters
from asyncrl.types import FinishReason, Rollout, RolloutGroup, Sample, VersionSpan
from asyncrl.groups import RewardGroups

QUEUE_REASONS = {DropReason.STALE, DropReason.UNUSED_AT_SHUTDOWN}  # all a queue ever decides
OLD_CHECKPOINTS = Path(__file__).parent / "data" / "checkpoint_259b0a0"  # written by the code at 259b0a0


class ZeroLoss(Loss):
    """Trains nothing; raises on the steps listed in ``fail_at`` (1-based)."""

    min_group_size = 1

    def __init__(self, fail_at: tuple[int, ...] = ()) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def compute(self, model, groups, **kw):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError("this step fails")
        return LossOutput(loss=model.weight.sum() * 0.0, metrics={}, num_tokens=sum(g.num_tokens for g in groups))


def config(max_staleness: int = 1, producers: int = 2) -> PipelineConfig:
    # Without admission, so that queued groups can go stale: the stale drop is one of the fates on the books.
    return PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=4), max_inflight_groups=8),
                          queue=QueueConfig(capacity=8, max_staleness=max_staleness, admission=False),
                          learner=LearnerConfig(batch_groups=2, sync=SyncConfig(every=1)), num_producers=producers)


def mixed_prompts(count: int) -> list[Prompt]:
    """Every 7th prompt is empty (a producer drops it); answer 3 marks a prompt whose reward is NaN."""
    return [Prompt(f"p{i}", () if i % 7 == 6 else (1, 2, 3), answer=3 if i % 5 == 3 else 0) for i in range(count)]


def reward(prompt: Prompt, sample: Sample) -> float:
    return math.nan if prompt.answer == 3 else 1.0


def group(gid: str, version: int = 0) -> RolloutGroup:
    r = Rollout(Sample((2,), (-1.0,), FinishReason.STOP, (VersionSpan(version, 0, 1),)), 1.0)
    return RolloutGroup(gid, Prompt(gid, (1,)), (r, r))


async def test_each_fate_is_on_the_books_of_the_component_that_decided_it():
    pipe = grpo_pipeline(FakeEngine(token_delay_s=0.001), torch.nn.Linear(2, 2), mixed_prompts(1000),
                         RewardGroups(reward),
                         config(max_staleness=0), loss=ZeroLoss())
    result = await pipe.run(steps=8)
    queue, learner = pipe.receiver.counters, pipe.learner.counters
    producers = [p.counters for p in pipe.producers]
    assert set(queue.dropped) <= QUEUE_REASONS, f"the queue counted others' drops: {dict(queue.dropped)}"
    before = Drops()
    for p in producers:
        before.merge(p.dropped)
    assert before[DropReason.EMPTY_PROMPT] > 0 and before[DropReason.REWARD_INVALID] > 0
    assert queue.dropped[DropReason.STALE] > 0, "with staleness 0, queued groups go stale"
    assert set(learner.dropped) <= {DropReason.UNUSED_AT_SHUTDOWN}
    # Each component's books balance on their own ...
    assert sum(p.groups - p.duplicates for p in producers) == queue.entered
    assert queue.entered == queue.handed_out + sum(queue.dropped.values()) + pipe.receiver.depth
    assert queue.handed_out == learner.groups_trained + sum(learner.dropped.values()) == 16
    # ... and the result is their sum.
    dropped = Drops(before)
    dropped.merge(queue.dropped)
    dropped.merge(learner.dropped)
    assert result.dropped == {r.value: n for r, n in dropped.items()}
    assert (result.groups_trained, result.samples_trained) == (16, 32) == (learner.groups_trained,
                                                                          learner.samples_trained)
    assert result.unaccounted == 0


async def test_a_failed_step_is_the_learners_drop_and_leaves_the_queue_books_alone():
    clock = VersionClock()
    sender, receiver = create_rollout_queue(QueueConfig(capacity=8, max_staleness=4), clock)
    model = torch.nn.Linear(2, 2)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroLoss(fail_at=(2,)), receiver,
                      WeightSync(FakeEngine(), clock, SyncConfig()), LearnerConfig(batch_groups=2))
    for i in range(4):
        await sender.send(group(f"g{i}"))
    await learner.train_and_publish(await receiver.receive_batch(2))
    batch = await receiver.receive_batch(2)
    queue_before = (dict(receiver.counters.dropped), receiver.counters.entered, receiver.counters.handed_out)
    with pytest.raises(RuntimeError, match="this step fails"):
        await learner.train_and_publish(batch)
    assert (dict(receiver.counters.dropped), receiver.counters.entered, receiver.counters.handed_out) == \
        queue_before, "the learner wrote the queue's books"
    assert learner.counters == LearnerCounters(groups_trained=2, samples_trained=4, tokens_trained=4,
                                               dropped=Drops({DropReason.UNUSED_AT_SHUTDOWN: 2}))
    totals = learner.totals()
    assert (totals.queued, totals.trained, totals.total_dropped, totals.unaccounted(receiver.depth)) == (4, 2, 2, 0)
    await learner.close()


async def test_an_unfinished_receive_is_the_queues_drop_and_not_handed_out():
    sender, receiver = create_rollout_queue(QueueConfig(capacity=8, max_staleness=4), VersionClock())
    await sender.send(group("a"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):  # one group of the two it waits for: the batch never completes
            await receiver.receive_batch(2)
    c = receiver.counters
    assert (c.entered, c.handed_out, dict(c.dropped)) == (1, 0, {DropReason.UNUSED_AT_SHUTDOWN: 1})
    assert receiver.statistics().handed_out == 0 and receiver.statistics().staleness == {}


async def test_groups_metrics_of_every_step_are_the_totals_under_the_names_users_know():
    seen: list[tuple[dict[str, float], dict[str, float]]] = []
    pipe = grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), mixed_prompts(200), RewardGroups(reward), config(),
                         loss=ZeroLoss())
    pipe.learner.hooks.append(lambda step, metrics: seen.append((dict(metrics), pipe.totals().metrics())))
    await pipe.run(steps=5)
    assert len(seen) == 5
    for step, (metrics, totals) in enumerate(seen, 1):
        assert {k: v for k, v in metrics.items() if k.startswith("groups/")} == totals
        assert metrics["groups/trained"] == 2 * step and metrics["groups/queued"] >= 2 * step
    last = seen[-1][0]
    assert last["groups/dropped_empty_prompt"] > 0 and last["groups/dropped_reward_invalid"] > 0, \
        "the producers' drops are in the learner's per-step metrics"
    assert last["groups/dropped"] == sum(v for k, v in last.items() if k.startswith("groups/dropped_"))


def test_add_up_sums_each_components_books_and_a_checkpoints_totals():
    producers = [ProducerCounters(dropped=Drops({DropReason.EMPTY_PROMPT: 2})),
                 ProducerCounters(dropped=Drops({DropReason.EMPTY_PROMPT: 1, DropReason.REWARD_ERROR: 4}))]
    queue = QueueCounters(entered=20, handed_out=12, dropped=Drops({DropReason.STALE: 4}))
    learner = LearnerCounters(groups_trained=10, samples_trained=40,
                              dropped=Drops({DropReason.UNUSED_AT_SHUTDOWN: 2}))
    previous = GroupTotals(queued=5, trained=4, samples_trained=16, dropped=Drops({DropReason.STALE: 1}))
    totals = add_up(queue, learner, producers, previous)
    assert (totals.queued, totals.trained, totals.samples_trained, totals.dropped_before_queue) == (25, 14, 56, 7)
    assert totals.dropped == {DropReason.EMPTY_PROMPT: 3, DropReason.REWARD_ERROR: 4, DropReason.STALE: 5,
                              DropReason.UNUSED_AT_SHUTDOWN: 2}
    assert totals.unaccounted(in_queue=4) == 25 - 14 - (14 - 7) - 4 == 0
    assert totals.describe_drops() == "stale 5, reward_error 4, empty_prompt 3, unused_at_shutdown 2"
    assert producers[0].dropped == {DropReason.EMPTY_PROMPT: 2}, "adding up writes no book"
    assert json.loads(json.dumps(asdict(producers[1])))["dropped"] == {"empty_prompt": 1, "reward_error": 4}


def test_checkpoint_meta_keeps_the_layout_earlier_checkpoints_have():
    totals = GroupTotals(queued=7, trained=4, samples_trained=8, dropped=Drops({DropReason.STALE: 1}))
    meta = state_meta(TrainingState(step=5, version=4, published=True, cursor=9, counters=totals, queue_depth=2,
                                    in_flight=1))
    assert meta["format"] == 2 and meta["samples_trained"] == 8
    assert meta["counters"] == {"queued": 7, "trained": 4, "dropped": {"stale": 1}, "dropped_before_queue": 0}


async def test_a_checkpoint_written_by_the_earlier_code_restores_and_its_books_go_on():
    saved = latest(OLD_CHECKPOINTS)
    assert saved is not None and saved.step == 5
    state = restore(saved, torch.nn.Linear(4, 3))
    lost = {DropReason.UNUSED_AT_SHUTDOWN: 3}  # 2 queued + 1 in flight when it was saved
    assert state.counters == restored_counters(saved.meta) == GroupTotals(
        queued=7, trained=4, samples_trained=8, dropped=Drops({DropReason.REWARD_INVALID: 2, DropReason.STALE: 1,
                                                               **lost}), dropped_before_queue=3)
    assert state.counters.unaccounted(0) == 0
    items = [Prompt(f"p{i}", (1, 2, 3)) for i in range(100)]
    pipe, _ = await resume_pipeline(FakeEngine(), torch.nn.Linear(4, 3), items, RewardGroups(lambda p, s: 1.0),
                                    config(),
                                    checkpoint=saved, loss=ZeroLoss())
    result = await pipe.run(steps=7)
    assert result.steps == 7 and result.groups_trained == 4 + 2 * 2 and result.samples_trained == 8 + 2 * 2 * 2
    assert result.dropped["reward_invalid"] == 2 and result.unaccounted == 0
