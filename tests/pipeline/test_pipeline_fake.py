"""Fast tests of scheduling and accounting with the in-memory FakeEngine (the real engine is in
test_pipeline_vllm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading

import pytest
import torch

from asyncrl.engines.updates import InMemory
from asyncrl import (
    AbortPolicy, ConfigError, DropReason, InvalidGroupError, InvalidGroupPolicy, LearnerConfig, PipelineConfig,
    ProducerConfig, Prompt, QueueClosed, QueueConfig, SamplingConfig, SyncConfig, VersionClock,
)
from asyncrl.actors.producer import Producer
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.protocols import WeightUpdate
from asyncrl.queues.rollout_queue import is_fresh, create_rollout_queue
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import FinishReason, PauseMode, Rollout, RolloutGroup, Sample, VersionSpan
from asyncrl.groups import RewardGroups
from tests.support.pipelines import RecordingLoss, SignallingSink, config, make_pipeline, prompts, tiny_model


def group(gid: str, version: int) -> RolloutGroup:
    r = Rollout(Sample((2,), (-1.0,), FinishReason.STOP, (VersionSpan(version, 0, 1),)), 1.0)
    return RolloutGroup(gid, Prompt(gid, (1,)), (r,))


def test_staleness_rule_is_a_pure_function():
    assert is_fresh(group("a", 3), policy_version=4, max_staleness=1)
    assert not is_fresh(group("a", 2), policy_version=4, max_staleness=1)
    assert is_fresh(group("a", 4), policy_version=4, max_staleness=0)


async def test_run_trains_and_accounts_for_every_group():
    engine = FakeEngine()
    pipe = make_pipeline(engine, prompts(1000), config(producers=2))
    stats = await pipe.run(steps=10)
    assert stats.steps == 10 and stats.version == 10
    assert stats.groups_trained == 20
    assert stats.unaccounted == 0
    assert engine.closed
    assert engine.weights, "the learner's weights were published"


class CountingBackend:
    """``LocalBackend`` that counts its steps: proves the learner trained through the backend it was given."""

    def __init__(self, cfg: LearnerConfig) -> None:
        from asyncrl.actors.training import LocalBackend

        model = tiny_model()
        self.inner = LocalBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-3), RecordingLoss(), cfg)
        self.loss, self.model, self.optimizer, self.steps = self.inner.loss, model, self.inner.optimizer, 0

    def train_step(self, batch, step):
        self.steps += 1
        return self.inner.train_step(batch, step)

    def __getattr__(self, name):  # publication_state, snapshot, release
        return getattr(self.inner, name)


async def test_grpo_pipeline_trains_through_a_given_backend():
    engine, cfg = FakeEngine(), config()
    backend = CountingBackend(cfg.learner)
    pipe = grpo_pipeline(engine, None, prompts(100), RewardGroups(lambda p, s: 1.0), cfg, backend=backend)
    stats = await pipe.run(steps=3)
    assert backend.steps == 3 and stats.version == 3 and stats.unaccounted == 0
    assert torch.equal(engine.weights["weight"], backend.model.weight.detach())


def test_grpo_pipeline_refuses_a_model_beside_a_backend():
    with pytest.raises(ConfigError, match="grpo_pipeline.backend: the backend owns the model"):
        grpo_pipeline(FakeEngine(), tiny_model(), prompts(1), RewardGroups(lambda p, s: 1.0), config(),
                      backend=CountingBackend(LearnerConfig()))


async def test_stale_groups_never_reach_the_loss_and_are_counted():
    engine = FakeEngine(token_delay_s=0.001)
    cfg = config(max_staleness=0, capacity=8, batch=2, inflight=8, admission=False)  # gated: nothing goes stale
    pipe = make_pipeline(engine, prompts(1000), cfg)
    stats = await pipe.run(steps=8)
    loss = pipe.learner.loss
    assert loss.seen and all(staleness <= 0 for _, staleness in loss.seen)
    assert stats.dropped.get(DropReason.STALE.value, 0) > 0, "with staleness 0, queued groups go stale"
    assert stats.unaccounted == 0


async def test_backpressure_blocks_producers_and_bounds_the_queue():
    gate = threading.Event()
    engine = FakeEngine()
    loss = RecordingLoss(gate=gate)
    cfg = config(capacity=3, batch=2, inflight=4, producers=2, admission=False)  # the bound when ungated
    pipe = make_pipeline(engine, prompts(10_000), cfg, loss=loss)
    blocked = asyncio.Event()
    for p in pipe.producers:
        p.sink = SignallingSink(p.sink, pipe.receiver, blocked)
    run = asyncio.create_task(pipe.run(steps=3))
    await asyncio.wait_for(blocked.wait(), 10)
    requests_when_blocked = engine.requests
    assert pipe.receiver.depth == 3
    # Producers hold at most max_inflight groups each; they cannot run ahead of the full queue.
    assert requests_when_blocked <= 3 + 2 + 2 * 4
    gate.set()
    stats = await asyncio.wait_for(run, 20)
    assert pipe.receiver.statistics().max_depth <= 3
    assert stats.unaccounted == 0


@pytest.mark.parametrize("bad, reason", [
    (lambda p, s: 1 / 0, DropReason.REWARD_ERROR),
    (lambda p, s: math.nan, DropReason.REWARD_INVALID),
    (lambda p, s: "1.0", DropReason.REWARD_INVALID),
    (lambda p, s: None, DropReason.REWARD_INVALID),
])
async def test_bad_rewards_are_dropped_with_a_reason(bad, reason):
    calls = 0

    async def reward(p, s):
        nonlocal calls
        calls += 1
        return bad(p, s) if p.prompt_id == "p0" else 1.0

    pipe = make_pipeline(FakeEngine(), prompts(50), config(), reward=reward)
    stats = await pipe.run(steps=3)
    assert stats.dropped.get(reason.value) == 1


async def test_bad_prompts_are_dropped_with_a_reason():
    items = [Prompt("empty", ()), Prompt("long", tuple(range(300)))] + prompts(40)
    pipe = make_pipeline(FakeEngine(max_model_len=256), items, config())
    stats = await pipe.run(steps=3)
    assert stats.dropped[DropReason.EMPTY_PROMPT.value] == 1
    assert stats.dropped[DropReason.PROMPT_TOO_LONG.value] == 1


async def test_fail_fast_policy_stops_the_run_with_the_error():
    pipe = make_pipeline(FakeEngine(), prompts(50), config(on_invalid=InvalidGroupPolicy.FAIL),
                         reward=lambda p, s: 1 / 0)
    with pytest.raises(InvalidGroupError, match="reward_error"):
        await pipe.run(steps=3)
    assert pipe.engine.closed


async def test_learner_exception_stops_everything_and_reaches_the_caller():
    class Boom(RecordingLoss):
        def compute(self, model, groups, **kw):
            raise RuntimeError("learner exploded")

    engine = FakeEngine()
    pipe = make_pipeline(engine, prompts(1000), config(), loss=Boom())
    with pytest.raises(RuntimeError, match="learner exploded"):
        await pipe.run(steps=3)
    assert engine.closed
    assert all(p.in_flight == 0 for p in pipe.producers)


async def test_cancelling_run_shuts_down():
    engine = FakeEngine(token_delay_s=0.01)
    pipe = make_pipeline(engine, prompts(10_000), config())
    run = asyncio.create_task(pipe.run(steps=10_000))
    await asyncio.wait_for(_until_trained(pipe, 1), 10)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert engine.closed
    assert pipe.receiver.closed
    assert pipe.result.unaccounted == 0


async def _until_trained(pipe, steps):
    reached = asyncio.Event()
    pipe.learner.hooks.append(lambda step, m: reached.set() if step >= steps else None)
    await reached.wait()


async def test_finite_data_ends_the_run_gracefully():
    pipe = make_pipeline(FakeEngine(), prompts(7), config(batch=2, max_staleness=100))
    stats = await pipe.run(steps=None)
    assert stats.steps == 3  # 7 groups -> 3 full batches; the 7th group is counted unused
    assert stats.dropped[DropReason.UNUSED_AT_SHUTDOWN.value] == 1
    assert stats.unaccounted == 0


async def test_abort_cut_samples_are_resubmitted_or_dropped():
    for policy, expect_drop in ((AbortPolicy.RESUBMIT, False), (AbortPolicy.DROP, True)):
        engine = FakeEngine(token_delay_s=0.005)
        sender, _receiver = create_rollout_queue(QueueConfig(capacity=4), VersionClock())
        producer = Producer(engine, PromptSource(prompts(1)), RewardGroups(lambda p, s: 1.0), sender,
                            ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=50), on_abort=policy))
        task = asyncio.create_task(producer.produce_one(0, prompts(1)[0]))
        await asyncio.wait_for(engine.token_produced.wait(), 10)
        await engine.pause(PauseMode.ABORT, clear_cache=False)
        await engine.load(WeightUpdate(1, InMemory({})))
        await engine.resume()
        result = await asyncio.wait_for(task, 10)
        if expect_drop:
            assert result is None and producer.counters.dropped[DropReason.ABORTED] == 1
        else:
            assert result is not None and producer.counters.sampling.resubmitted == 2
            assert all(r.sample.finish_reason is FinishReason.LENGTH and r.sample.oldest_version == 1
                       for r in result.rollouts)


async def test_queue_rejects_duplicates_and_closes():
    sender, receiver = create_rollout_queue(QueueConfig(capacity=2), VersionClock())
    assert await sender.send(group("g", 0)) is True
    assert await sender.send(group("g", 0)) is False
    receiver.close()
    with pytest.raises(QueueClosed):
        await sender.send(group("h", 0))
    assert receiver.counters.dropped[DropReason.UNUSED_AT_SHUTDOWN] == 1


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingConfig(n=0), "SamplingConfig.n"),
    (lambda: SamplingConfig(max_tokens=-1), "SamplingConfig.max_tokens"),
    (lambda: SamplingConfig(temperature=0), "SamplingConfig.temperature"),
    (lambda: QueueConfig(capacity=0), "QueueConfig.capacity"),
    (lambda: QueueConfig(max_staleness=-1), "QueueConfig.max_staleness"),
    (lambda: SyncConfig(mode="pause-ish"), "SyncConfig.mode"),
    (lambda: SyncConfig(every=0), "SyncConfig.every"),
    (lambda: LearnerConfig(batch_groups=0), "LearnerConfig.batch_groups"),
    (lambda: LearnerConfig(lr=-1.0), "LearnerConfig.lr"),
    (lambda: ProducerConfig(on_abort="retry"), "ProducerConfig.on_abort"),
    (lambda: PipelineConfig(queue=QueueConfig(capacity=2), learner=LearnerConfig(batch_groups=3)),
     "PipelineConfig.learner.batch_groups"),
])
def test_bad_config_fails_at_construction_naming_the_field(make, field):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.field == field and field in str(err.value)


def test_missing_model_path_is_a_config_error(tmp_path):
    """The config holds values only; the engine's start checks the directory before starting anything."""
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    cfg = VLLMEngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="VLLMEngineConfig.model") as err:
        asyncio.run(VLLMEngine.start(cfg))
    assert str(tmp_path / "nope") in str(err.value)


def test_engine_busy_wait_picks_the_executor(tiny_model_dir):
    """busy_wait=False selects asyncrl's napping executor (by name, loaded in EngineCore); True leaves vLLM's
    choice; None naps on CPU (this machine); ``extra`` still overrides; a non-bool is a ConfigError."""
    from asyncrl.engines.vllm_local.config import EXECUTOR_QUALNAME, VLLMEngineConfig, engine_args
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    def backend(**kw):
        return engine_args(VLLMEngineConfig(model=str(tiny_model_dir), **kw)).distributed_executor_backend

    assert issubclass(resolve_obj_by_qualname(EXECUTOR_QUALNAME), MultiprocExecutor)
    assert backend(busy_wait=False) == EXECUTOR_QUALNAME
    assert backend(busy_wait=None) == EXECUTOR_QUALNAME
    assert backend(busy_wait=True) != EXECUTOR_QUALNAME
    assert backend(busy_wait=False, extra={"distributed_executor_backend": "mp"}) == "mp"
    with pytest.raises(ConfigError, match="VLLMEngineConfig.busy_wait"):
        VLLMEngineConfig(model=str(tiny_model_dir), busy_wait="no")


class SlowPublishEngine(FakeEngine):
    """Weight loads wait until ``held`` is set: a publication the test can hold in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.held = asyncio.Event()

    async def load(self, update) -> None:
        await self.held.wait()
        await super().load(update)


async def test_overlapped_publication_trains_the_next_step_meanwhile():
    engine = SlowPublishEngine()
    loop = asyncio.get_running_loop()
    seen_engine_versions: list[int] = []

    class GateLoss(RecordingLoss):
        def compute(self, model, groups, **kw):
            seen_engine_versions.append(engine.version)
            if len(seen_engine_versions) == 2:  # step 2 is training while publication 1 is still held
                loop.call_soon_threadsafe(engine.held.set)
            return super().compute(model, groups, **kw)

    cfg = config(max_staleness=2)
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(
        cfg.learner, sync=SyncConfig(overlap=True)))
    pipe = make_pipeline(engine, prompts(200), cfg, loss=GateLoss())
    stats = await asyncio.wait_for(pipe.run(steps=3), 30)
    assert seen_engine_versions[:2] == [0, 0], "step 2 trained before publication 1 landed"
    assert stats.version == engine.version == 3, "run() returns after the last publication landed"
    assert stats.unaccounted == 0 and pipe.learner.weight_sync.counters.published == 3


async def test_overlapped_publication_keeps_staleness_within_bounds():
    engine = FakeEngine(token_delay_s=0.0005)
    cfg = config(max_staleness=1, inflight=8)
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, sync=SyncConfig(overlap=True)))
    pipe = make_pipeline(engine, prompts(1000), cfg)
    pipe.learner.loss.version = lambda: pipe.learner.policy_version
    stats = await asyncio.wait_for(pipe.run(steps=12), 30)
    seen = [staleness for _, staleness in pipe.learner.loss.seen]
    assert seen and all(0 <= s <= 1 for s in seen), seen
    assert min(pipe.receiver.statistics().staleness) >= 0
    assert stats.version == engine.version == 12 and stats.unaccounted == 0


@pytest.mark.parametrize("use_uvloop", [False, True])
def test_runs_and_cancellation_under_asyncio_and_uvloop(use_uvloop):
    import asyncrl

    async def main():
        pipe = make_pipeline(FakeEngine(token_delay_s=0.001), prompts(1000), config(), reward=slow_enough)
        result = await pipe.run(steps=5)
        cut = make_pipeline(FakeEngine(token_delay_s=0.001), prompts(10_000), config(), reward=slow_enough)
        task = asyncio.create_task(cut.run(steps=10_000))
        await asyncio.wait_for(_until_trained(cut, 2), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return type(asyncio.get_running_loop()).__module__, result, cut

    loop_module, result, cut = asyncrl.run(main(), use_uvloop=use_uvloop)
    assert loop_module.startswith("uvloop") == use_uvloop
    assert result.steps == 5 and result.unaccounted == 0
    assert cut.receiver.closed and cut.engine.closed and cut.result.unaccounted == 0


def slow_enough(prompt, sample) -> float:
    """A synchronous reward: scored in a worker thread, so the run crosses threads under either loop."""
    return 1.0
