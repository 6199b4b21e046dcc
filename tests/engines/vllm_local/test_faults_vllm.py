"""Faults injected into the real vLLM engine: a killed engine core (fail, or restart), a weight update that
fails part-way, and a learner that fails during a sync."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import psutil
import pytest
import torch

from asyncrl.engines.updates import InMemory
from asyncrl import LearnerConfig, PauseMode, PipelineConfig, ProducerConfig, QueueConfig, SamplingConfig, SyncConfig
from asyncrl.config import SamplingConfig as Sampling
from asyncrl.engines import weights
from asyncrl.engines.protocols import EngineError, WeightUpdate, WeightUpdateError
from asyncrl.engines.supervisor import SupervisedEngine
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.engines.weights import state_dict_for_engine
from tests.support import apply_update, child_pids, engine_config, load_hf_model
from tests.support.pipelines import _assert_no_children, build
from tests.support.vllm_engine import _max_diff, _prompt, _publish

pytestmark = pytest.mark.vllm


def engine_core_pids(exclude: set[int]) -> list[int]:
    """EngineCore processes among this process's children, except those in ``exclude`` (other engines, such
    as the session engine, are children too)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited while we looked (a zombie too)
            if p.pid not in exclude and "EngineCore" in " ".join(p.cmdline()) + p.name():
                out.append(p.pid)
    return out


def config() -> PipelineConfig:
    return PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6)),
        queue=QueueConfig(capacity=8, max_staleness=2),
        learner=LearnerConfig(batch_groups=2, lr=1e-4, sync=SyncConfig(mode=PauseMode.KEEP)),
    )


def kill_after_step(pipe, step: int, killed_at: list[float], exclude: set[int]) -> None:
    """Kill the current engine's core process (the only EngineCore not in ``exclude``) after ``step``."""
    def hook(s, metrics):
        if s == step and not killed_at:
            [pid] = engine_core_pids(exclude)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
    pipe.learner.hooks.append(hook)


async def test_killed_engine_core_stops_the_run_with_an_error_naming_it(tiny_model_dir, tokenizer):
    """The pipeline awaits the engine's death event (set when vLLM's engine-core process exits): the run ends
    within seconds with an error naming the engine, and nothing polled ``check_alive`` (the watchdog used to,
    every second)."""
    before = child_pids()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16), name="engine-A")
    probes, check_alive = [], engine.check_alive

    async def counted_check_alive() -> None:
        probes.append(time.monotonic())
        await check_alive()

    engine.check_alive = counted_check_alive  # type: ignore[method-assign]
    pipe = build(engine, tiny_model_dir, tokenizer, config(), close_engine=True)
    killed_at: list[float] = []
    kill_after_step(pipe, 1, killed_at, exclude=before)
    with pytest.raises(EngineError, match="engine-A") as err:
        await pipe.run(steps=1000)
    detected_s = time.monotonic() - killed_at[0]
    assert detected_s < 5, f"death detected after {detected_s:.1f}s"
    assert "died" in str(err.value)
    assert probes == [], "the pipeline polled the engine's health"
    _assert_no_children(before)


async def test_an_idle_engine_whose_core_dies_says_so_at_once(tiny_model_dir):
    """No request in flight, so no stream fails: only the death event tells. ``wait_dead`` returns within
    seconds of the kill, and a control call then fails at once (vLLM would never answer it)."""
    before = child_pids()
    engine = await VLLMEngine.start(engine_config(tiny_model_dir), name="engine-C")
    try:
        dead = asyncio.create_task(engine.wait_dead())
        [pid] = engine_core_pids(before)
        os.kill(pid, signal.SIGKILL)
        error = await asyncio.wait_for(dead, 10)
        assert isinstance(error, EngineError) and "engine-C" in str(error) and "died" in str(error)
        with pytest.raises(EngineError, match="died"):
            await asyncio.wait_for(engine.pause(PauseMode.KEEP, False), 1)
    finally:
        await engine.close()
    _assert_no_children(before)


async def test_killed_engine_core_is_restarted_and_training_continues(tiny_model_dir, tokenizer):
    before = child_pids()
    starts = 0

    async def factory():
        nonlocal starts
        starts += 1
        return await VLLMEngine.start(engine_config(tiny_model_dir, max_num_seqs=16), name=f"engine-{starts}")

    engine = await SupervisedEngine.start(factory, max_restarts=1)
    pipe = build(engine, tiny_model_dir, tokenizer, config(), close_engine=True)
    killed_at: list[float] = []
    kill_after_step(pipe, 2, killed_at, exclude=before)
    stats = await pipe.run(steps=5)
    assert killed_at and engine.restarts == 1 and starts == 2
    assert stats.steps == 5 and stats.version == 5
    assert engine.version == 5, "the new engine carries the published versions on"
    assert stats.unaccounted == 0
    _assert_no_children(before)


@pytest.mark.asyncio(loop_scope="session")
async def test_update_failing_part_way_restores_previous_weights(vllm_engine, tiny_model_dir, tokenizer, monkeypatch):
    base = load_hf_model(tiny_model_dir)
    await _publish(vllm_engine, base)
    version = vllm_engine.version
    prompt, params = _prompt(tokenizer, "3+4="), Sampling(n=4, max_tokens=10, ignore_eos=True)

    bad = {k: v + torch.randn_like(v) * 0.1 for k, v in state_dict_for_engine(base).items()}
    last = sorted(bad)[-1]  # loaded last: every earlier layer is already replaced when it fails
    bad[last] = torch.zeros(bad[last].shape[0] + 1)
    monkeypatch.setattr(weights, "validate_update", lambda tensors, manifest: None)  # let it through
    await vllm_engine.pause(PauseMode.KEEP, clear_cache=True)
    try:
        with pytest.raises(WeightUpdateError, match="restored"):
            await apply_update(vllm_engine, WeightUpdate(version + 1, InMemory(bad)))
    finally:
        await vllm_engine.resume()
    assert vllm_engine.version == version
    samples = await vllm_engine.generate(prompt, params, request_id="after-partial")
    assert _max_diff(base, prompt, samples) < 2e-3, "the engine holds exactly the previous weights"
    assert all(s.newest_version == version for s in samples)


@pytest.mark.asyncio(loop_scope="session")
async def test_learner_failing_during_sync_leaves_engine_resumed(vllm_engine, tiny_model_dir, tokenizer):
    pipe = build(vllm_engine, tiny_model_dir, tokenizer, config(), close_engine=False)

    class FailingLoad:
        """The real engine as the weight target, except that every load fails."""

        name, prepare, pause, resume, release = "failing", vllm_engine.prepare, vllm_engine.pause, \
            vllm_engine.resume, vllm_engine.release
        version = property(lambda self: vllm_engine.version)

        async def load(self, update):
            raise WeightUpdateError("injected transfer failure")

    pipe.learner.weight_sync.target = FailingLoad()
    with pytest.raises(WeightUpdateError, match="injected"):
        await pipe.run(steps=3)
    assert not await vllm_engine.llm.is_paused(), "a failed sync still resumes generation"
    [s] = await vllm_engine.generate(_prompt(tokenizer), Sampling(n=1, max_tokens=3), request_id="still-alive")
    assert s.token_ids
