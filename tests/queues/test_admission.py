"""Staleness-aware admission (asyncrl/queues/admission.py): the rule, its waiter, and pipelines under the fake
engine with random and heavy-tailed lengths where nothing is dropped as stale."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl import LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig, SyncConfig
from asyncrl.engines.fake import FakeEngine
from asyncrl.errors import QueueClosed
from asyncrl.queues.admission import AdmissionGate, admits
from asyncrl.versions import VersionClock
from tests.support.pipelines import RecordingLoss, make_pipeline


def test_the_rule_allows_max_staleness_plus_one_versions_of_groups():
    # K = 4 groups per version, origin 0, bound 1: 8 groups while version 0 is served, 12 once 1 is
    assert admits(7, served=0, origin=0, max_staleness=1, per_version=4)
    assert not admits(8, served=0, origin=0, max_staleness=1, per_version=4)
    assert admits(11, served=1, origin=0, max_staleness=1, per_version=4)
    # a resumed run 3 groups into its cycle has 3 fewer places; bound 0 allows the current version's groups only
    assert not admits(5, served=0, origin=0, max_staleness=1, per_version=4, offset=3)
    assert admits(3, served=5, origin=5, max_staleness=0, per_version=4)
    assert not admits(4, served=5, origin=5, max_staleness=0, per_version=4)


def publish(clock: VersionClock) -> None:
    clock.begin(clock.served + 1)
    clock.commit(clock.served + 1)


async def test_gate_wakes_on_a_new_version_and_keeps_tickets_in_order():
    clock = VersionClock()
    gate = AdmissionGate(clock, max_staleness=0, per_version=2)
    assert [await gate.admit(), await gate.admit()] == [0, 1]
    waiter = asyncio.create_task(gate.admit())
    await asyncio.sleep(0)
    assert not waiter.done() and not gate.open_now()
    clock.begin(1)  # pending: tokens may still come from version 0, so no place yet
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.commit(1)
    assert await asyncio.wait_for(waiter, 5) == 2
    gate.release(1)
    assert gate.next_due == 0, "ticket 0 is still out: 1 waits behind it"
    gate.withdraw(0)
    assert gate.next_due == 2 and gate.admitted == 2


async def test_a_waiter_cancelled_after_its_wake_up_hands_its_place_on():
    clock = VersionClock()
    gate = AdmissionGate(clock, max_staleness=0, per_version=1)
    assert await gate.admit() == 0
    first, second = asyncio.create_task(gate.admit()), asyncio.create_task(gate.admit())
    await asyncio.sleep(0)
    publish(clock)  # grants ticket 1 to ``first`` synchronously
    first.cancel()  # before it ran: it must hand its ticket on
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 5) == 2
    assert gate.admitted == 2 and gate.withdrawn == 1
    gate.release(0)
    assert gate.next_due == 2, "the withdrawn ticket 1 holds nothing up"


async def test_a_waiter_cancelled_before_its_turn_leaves_and_close_wakes_the_rest():
    clock = VersionClock()
    gate = AdmissionGate(clock, max_staleness=0, per_version=1)
    await gate.admit()
    early, late = asyncio.create_task(gate.admit()), asyncio.create_task(gate.admit())
    await asyncio.sleep(0)
    early.cancel()
    with pytest.raises(asyncio.CancelledError):
        await early
    publish(clock)
    assert await asyncio.wait_for(late, 5) == 1 and gate.withdrawn == 0
    blocked = asyncio.create_task(gate.admit())
    await asyncio.sleep(0)
    gate.close()
    with pytest.raises(QueueClosed):
        await asyncio.wait_for(blocked, 5)
    with pytest.raises(QueueClosed):
        await gate.admit()


def uniform(rng: random.Random):
    return lambda ids, i: rng.randint(1, 24)


def heavy_tailed(rng: random.Random):
    return lambda ids, i: min(64, int(rng.paretovariate(1.1)))  # mostly 1-3 tokens, now and then 64


def pipeline_config(max_staleness: int, every: int = 1, overlap: bool = False, admission: bool = True):
    return PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=64), max_inflight_groups=4),
        queue=QueueConfig(capacity=4, max_staleness=max_staleness, admission=admission),
        learner=LearnerConfig(batch_groups=2, sync=SyncConfig(every=every, overlap=overlap)), num_producers=3)


class TicketSpy:
    """A producer's sink that notes the ticket each group is sent with."""

    def __init__(self, inner, ticket_of: dict[str, int]) -> None:
        self.inner, self.ticket_of = inner, ticket_of

    async def send(self, group, *, ticket=None):
        self.ticket_of[group.group_id] = ticket
        return await self.inner.send(group, ticket=ticket)

    async def aclose(self) -> None:
        await self.inner.aclose()


def recording_pipeline(lengths, cfg: PipelineConfig, seed: int):
    engine = FakeEngine(token_delay_s=0.0005, length_fn=lengths(random.Random(seed)))
    items = [Prompt(f"p{i}", (1, 2, 3), answer=i) for i in range(5000)]
    pipe = make_pipeline(engine, items, cfg, loss=RecordingLoss())
    tickets: list[int] = []
    ticket_of: dict[str, int] = {}  # the admission ticket each group was sent with (the queue's envelope)
    for producer in pipe.producers:
        producer.sink = TicketSpy(producer.sink, ticket_of)
    original = pipe.learner.train_and_publish

    async def recording(batch):
        tickets.extend(ticket_of[g.group_id] for g in batch)
        return await original(batch)

    pipe.learner.train_and_publish = recording
    return pipe, tickets


@pytest.mark.parametrize("lengths", [uniform, heavy_tailed])
@pytest.mark.parametrize("max_staleness, every, overlap", [(1, 1, False), (2, 1, False), (4, 1, False),
                                                           (1, 2, True)])
async def test_no_group_is_dropped_as_stale_and_every_trained_group_is_within_the_bound(
        lengths, max_staleness, every, overlap):
    pipe, tickets = recording_pipeline(lengths, pipeline_config(max_staleness, every, overlap), seed=max_staleness)
    async with asyncio.timeout(60):  # no deadlock
        stats = await pipe.run(steps=24)
    seen = [staleness for _, staleness in pipe.learner.loss.seen]
    assert len(seen) == 48 and max(seen) <= max_staleness
    assert "stale" not in stats.dropped, stats.dropped
    assert stats.unaccounted == 0 and stats.groups_trained == 48
    assert tickets == sorted(tickets), "groups are trained in start order"
    assert len(set(tickets)) == 48


async def test_batches_are_the_earliest_started_groups_whatever_their_length():
    pipe, tickets = recording_pipeline(heavy_tailed, pipeline_config(1), seed=7)
    metrics: list[dict[str, float]] = []
    pipe.learner.hooks.append(lambda step, m: metrics.append(dict(m)))
    async with asyncio.timeout(60):
        await pipe.run(steps=24)
    assert tickets == list(range(48)), "the first 48 groups started, long ones included, in that order"
    last = metrics[-1]
    assert last["tokens/trained"] > 0 and last.get("tokens/dropped_stale", 0) == 0
    assert sum(last[f"staleness/groups_s{s}"] for s in (0, 1)) == 2 and "staleness/groups_s2" not in last
    assert last["length/generated_mean"] > 0 and last["length/trained_mean_all"] > 0


def test_the_staleness_histogram_has_a_fixed_width_whatever_the_bound():
    """A million-version bound once made a million gauges per step (seconds of CPU each, in the engine-limit
    bench): groups 8 or more versions old share one bucket."""
    from asyncrl.queues.lengths import trained_gauges
    from asyncrl.types import Prompt, RolloutGroup

    group = RolloutGroup("g", Prompt("p", (1, 2)), ())
    gauges = trained_gauges([group] * 3, [0, 9, 10**5], 10**6)
    histogram = {k: v for k, v in gauges.items() if k.startswith("staleness/")}
    assert len(histogram) == 9 and histogram["staleness/groups_s0"] == 1
    assert histogram["staleness/groups_s8plus"] == 2 and sum(histogram.values()) == 3
    assert list(trained_gauges([group], [1], 2)) == ["length/trained_mean"] + [f"staleness/groups_s{s}" for s in
                                                                                range(3)]


async def test_books_balance_when_a_gated_run_is_cancelled():
    pipe, _ = recording_pipeline(heavy_tailed, pipeline_config(2), seed=3)
    fifth = asyncio.Event()
    pipe.learner.hooks.append(lambda step, m: fifth.set() if step >= 5 else None)
    run = asyncio.create_task(pipe.run(steps=10_000))
    await asyncio.wait_for(fifth.wait(), 30)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert pipe.result.unaccounted == 0 and "stale" not in pipe.result.dropped


async def test_a_huge_staleness_bound_still_bounds_what_is_started_and_not_trained():
    # The window alone would admit a million groups: the queue's capacity plus the producers' in-flight slots
    # bound what is started and not yet handed to the learner, so memory stays bounded (it did not, at first).
    cfg = pipeline_config(1_000_000)
    pipe, tickets = recording_pipeline(uniform, cfg, seed=11)
    limit = cfg.queue.capacity + cfg.num_producers * cfg.producer.max_inflight_groups
    gate = pipe.producers[0].admission
    most = 0

    def watch(step: int, m: dict[str, float]) -> None:
        nonlocal most
        most = max(most, int(m["admission/outstanding"]))

    pipe.learner.hooks.append(watch)
    async with asyncio.timeout(60):
        stats = await pipe.run(steps=24)
    assert stats.groups_trained == 48 and stats.unaccounted == 0
    assert 0 < most <= limit, (most, limit)
    assert gate.issued <= 48 + limit, f"{gate.issued} groups started for 48 trained (limit {limit})"
