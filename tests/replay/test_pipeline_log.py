"""The rollout log wired into a pipeline (on the FakeEngine): every trained batch in the order trained, the drops
the books counted meanwhile, and the log closed however the run ends."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from asyncrl.config import RolloutLogConfig
from asyncrl.engines.fake import FakeEngine
from asyncrl.rollout_log import header, read
from asyncrl.types import DropReason
from tests.support.pipelines import config, make_pipeline, prompts


def with_log(cfg, directory):
    return dataclasses.replace(cfg, rollout_log=RolloutLogConfig(directory, steps_per_file=3), progress=False)


def log_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncrl-rollout-log")]


async def test_the_log_holds_every_trained_batch_and_the_drops_between_them(tmp_path):
    engine = FakeEngine(token_delay_s=0.001)
    cfg = with_log(config(max_staleness=0, inflight=6, capacity=8, batch=2, admission=False), tmp_path)
    pipe = make_pipeline(engine, prompts(200), cfg)
    gauges: list[float] = []
    pipe.learner.hooks.append(lambda step, metrics: gauges.append(metrics["rollout_log/pending"]))
    result = await pipe.run(8)
    steps = list(read(tmp_path))
    assert [s.step for s in steps] == list(range(1, 9))
    assert sum(len(s.groups) for s in steps) == result.groups_trained == 16
    assert [st for s in steps for st in (g.staleness(s.policy_version) for g in s.groups)] == \
        [st for _, st in pipe.learner.loss.seen], "the batches the loss saw, in its order"
    assert all(s.policy_version == s.step - 1 for s in steps)
    logged = sum((dict(s.drops).get(DropReason.STALE, 0) for s in steps), 0)
    assert 0 < logged <= result.dropped.get("stale", 0), "stale drops per step, from the books"
    named = [gid for s in steps for gid, reason in s.dropped if reason == DropReason.STALE]
    assert named and len(named) == len(set(named)) and len(named) <= logged, "stale groups the queue dropped, by id"
    assert header(tmp_path)["loss"] is None, "a loss of the caller's own: a replay must be given it"
    assert len(gauges) == 8, "the log's gauges are in every step's metrics"
    assert not log_threads(), "the writer's thread ended with the run"


async def test_a_cancelled_run_closes_the_log_with_its_steps_whole(tmp_path):
    engine = FakeEngine(token_delay_s=0.001)
    pipe = make_pipeline(engine, prompts(10_000), with_log(config(batch=2), tmp_path))
    stepped = asyncio.Event()
    pipe.learner.hooks.append(lambda step, metrics: stepped.set() if step >= 3 else None)
    run = asyncio.create_task(pipe.run(None))
    await asyncio.wait_for(stepped.wait(), 30)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    steps = [s.step for s in read(tmp_path)]
    assert steps == list(range(1, pipe.learner.step + 1)) and len(steps) >= 3
    assert not log_threads()
