"""The promises that broke under independent use of the first version, one test (or more) each: a slow reward
never stalls the event loop, runs that cannot learn say so, staged weights never outlive their process, a
checkpoint during an overlapped publication records the exact version, slow work stays off the event loop
and out of the pause, packaging matches the code, and the engines share one behaviour."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import tomllib
from pathlib import Path

import pytest
import torch

from asyncrl import (
    ConfigError, DropReason, EngineError, NoProgressError, PauseMode, Prompt, SyncConfig, VersionClock, WeightSync,
)
from asyncrl.engines import weights
from asyncrl.engines.updates import AdapterWeights
from asyncrl.lora import LoraConfig
from asyncrl.engines.common import RESTORE_ATTEMPTS, finish_reason, restore_good_weights
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.supervisor import SupervisedEngine
from asyncrl.recipes import grpo_pipeline
from asyncrl.groups import RewardGroups
from tests.support.pipelines import LoopLag, RecordingLoss, config, prompts, slow_reward

ROOT = Path(__file__).resolve().parents[2]


# -- 2. a synchronous reward runs off the event loop, under a timeout ------------------------------------------


async def test_a_blocking_reward_does_not_stall_the_event_loop():
    pipe = grpo_pipeline(FakeEngine(token_delay_s=0.001), torch.nn.Linear(2, 2), prompts(1000),
                         RewardGroups(slow_reward),
                         config(inflight=4, n=2), loss=RecordingLoss())
    async with LoopLag() as lag:
        result = await pipe.run(steps=4)
    assert result.steps == 4 and result.unaccounted == 0
    assert lag.worst < 0.05, f"event loop stalled for {lag.worst * 1000:.0f} ms"


async def test_a_reward_past_its_timeout_is_a_counted_drop():
    async def stuck(prompt, sample) -> float:
        if prompt.prompt_id == "p1":
            await asyncio.Event().wait()  # never answers
        return 1.0

    cfg = config()
    cfg = dataclasses.replace(cfg, producer=dataclasses.replace(cfg.producer, reward_timeout_s=0.2))
    result = await asyncio.wait_for(grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(20),
                                                  RewardGroups(stuck), cfg,
                                                  loss=RecordingLoss()).run(steps=None), 30)
    assert result.dropped.get(DropReason.REWARD_TIMEOUT.value) == 1
    assert result.unaccounted == 0


async def test_rewards_that_hang_in_their_threads_stop_the_run():
    gate = threading.Event()  # set only at the end: until then every call hangs in its thread

    def hangs(prompt, sample) -> float:
        gate.wait(5)
        return 1.0

    cfg = config(inflight=4)
    cfg = dataclasses.replace(cfg, producer=dataclasses.replace(cfg.producer, reward_timeout_s=0.1,
                                                                reward_threads=2))
    try:
        with pytest.raises(NoProgressError, match="reward function hangs"):
            await grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(100), RewardGroups(hangs), cfg,
                                loss=RecordingLoss()).run(steps=3)
    finally:
        gate.set()


# -- 4. runs that cannot learn say so --------------------------------------------------------------------------


def test_grpo_with_one_sample_per_group_is_refused():
    from asyncrl.algorithms.losses import GRPOLoss, LossConfig

    with pytest.raises(ConfigError, match="SamplingConfig.n") as err:
        grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(10), RewardGroups(lambda p, s: 1.0), config(n=1))
    assert "at least 2" in str(err.value)
    with pytest.raises(ConfigError, match="SamplingConfig.n"):
        grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(10), RewardGroups(lambda p, s: 1.0), config(n=1),
                      loss=GRPOLoss(LossConfig(estimator="rloo")))
    # A loss that learns from single samples may allow it.
    grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(10), RewardGroups(lambda p, s: 1.0), config(n=1),
                  loss=RecordingLoss())


async def test_a_run_whose_every_reward_is_nan_fails_saying_why():
    pipe = grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(30), RewardGroups(lambda p, s: math.nan),
                         config(),
                         loss=RecordingLoss())
    with pytest.raises(NoProgressError, match=r"0 of 2 steps.*reward_invalid 30"):
        await pipe.run(steps=2)


async def test_an_endless_source_of_invalid_groups_fails_instead_of_spinning():
    def endless():
        i = 0
        while True:
            yield Prompt(f"e{i}", (1, 2))
            i += 1

    cfg = config()
    cfg = dataclasses.replace(cfg, producer=dataclasses.replace(cfg.producer, max_consecutive_drops=50))
    pipe = grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), endless(), RewardGroups(lambda p, s: math.inf), cfg,
                         loss=RecordingLoss())
    with pytest.raises(NoProgressError, match="last 50 groups were all dropped"):
        await asyncio.wait_for(pipe.run(steps=2), 30)


async def test_a_learner_starved_for_longer_than_its_stall_timeout_fails():
    cfg = config(max_staleness=0)
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, stall_timeout_s=0.5))
    engine = FakeEngine()
    await engine.pause(PauseMode.KEEP, clear_cache=False)  # nothing is ever generated
    pipe = grpo_pipeline(engine, torch.nn.Linear(2, 2), prompts(30), RewardGroups(lambda p, s: 1.0), cfg,
                         loss=RecordingLoss())
    with pytest.raises(NoProgressError, match="stall_timeout_s=0.5"):
        await asyncio.wait_for(pipe.run(steps=2), 30)


# -- 5. staged weights never outlive their process -------------------------------------------------------------


STAGE_AND_HANG = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from asyncrl.engines.weights import stage
    staged = stage({"w": torch.zeros(4)}, torch.float32, Path(sys.argv[1]))
    print(staged.path, flush=True)
    time.sleep(60)
""")


def test_staging_left_by_a_killed_process_is_collected_by_the_next_stage(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", STAGE_AND_HANG, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    left = Path(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert left.is_dir() and left.name.startswith(f"{weights.STAGING_PREFIX}{proc.pid}-")
    mine = weights.stage({"w": torch.ones(4)}, torch.float32, tmp_path)  # a later run stages into the same root
    assert not left.exists(), "the dead process's staging directory was collected"
    assert mine.path.is_dir()
    mine.release()
    assert not mine.path.exists() and list(tmp_path.iterdir()) == []


def test_staged_weights_are_removed_by_their_last_holder(tmp_path):
    staged = weights.stage({"w": torch.ones(2)}, torch.float32, tmp_path)
    second = staged.acquire()
    staged.release()
    assert second.path.is_dir()
    second.release()
    assert not second.path.exists()


@pytest.mark.parametrize("cut_after_s", [0.0, 0.005, 0.02, 0.05])
async def test_a_cancelled_stage_leaves_no_directory_once_the_cancellation_is_through(tmp_path, cut_after_s):
    manifest = {"w": weights.ParamSpec((8192, 4096), "F32")}  # 128 MiB: validating and writing take a while
    task = asyncio.create_task(weights.validate_and_stage({"w": torch.ones(8192, 4096)}, manifest, torch.float32,
                                                          tmp_path))
    await asyncio.sleep(cut_after_s)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(tmp_path.iterdir()) == []  # no waiting: the cancellation came through after the cleanup


class StagingFake(FakeEngine):
    """Counts its staged copies; ``slow`` members take a while to prepare."""

    def __init__(self, name: str, slow_s: float = 0.0) -> None:
        super().__init__(name=name)
        self.slow_s, self.held = slow_s, 0

    async def prepare(self, update):
        await asyncio.sleep(self.slow_s)
        self.held += 1
        return update

    def release(self, update) -> None:
        self.held -= 1


@pytest.mark.parametrize("cut_after_s", [0.0, 0.01, 0.03])
async def test_a_pool_cancelled_while_preparing_lets_go_of_every_members_staging(cut_after_s):
    from asyncrl.engines.pool import EnginePool

    members = [StagingFake("a"), StagingFake("b", 0.02), StagingFake("c", 0.5)]
    pool = EnginePool(members)
    clock = VersionClock(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(WeightSync(pool, clock, SyncConfig()).publish({"w": torch.ones(2)}), cut_after_s)
    assert [m.held for m in members] == [0, 0, 0]
    assert clock.served == 0 and all(m.version == 0 for m in members)


# -- 7. a checkpoint during an overlapped publication records the exact version ---------------------------------


class HeldLoad(FakeEngine):
    """Loads wait until ``go`` is set: a publication held in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def load(self, update) -> None:
        await self.go.wait()
        await super().load(update)


async def test_a_checkpoint_during_an_overlapped_publication_records_the_exact_version(tmp_path):
    from asyncrl.checkpoint import CheckpointConfig, Checkpointer, checkpoint_hook, latest

    engine = HeldLoad()
    cfg = config(max_staleness=4)
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, sync=SyncConfig(overlap=True)))
    pipe = grpo_pipeline(engine, torch.nn.Linear(2, 2), prompts(200), RewardGroups(lambda p, s: 1.0), cfg,
                         loss=RecordingLoss())
    loop = asyncio.get_running_loop()
    async with Checkpointer(CheckpointConfig(tmp_path, every_steps=1)) as ckpt:
        # The publication after step 1 is held until 0.1 s after the hooks start: the checkpoint hook runs
        # while it is in flight.
        pipe.learner.hooks += [lambda step, m: loop.call_later(0.1, engine.go.set),
                               checkpoint_hook(ckpt, pipe.learner, pipe.producers[0].prompts)]
        await pipe.run(steps=1)
    saved = latest(tmp_path)
    assert saved.step == 1 and saved.meta["version"] == 1 and saved.meta["published"], saved.meta


# -- 8. slow work stays off the event loop and out of the pause ------------------------------------------------


async def test_validating_and_staging_a_large_update_does_not_stall_the_event_loop(tmp_path):
    tensors = {f"w{i}": torch.randn(1024, 1024) for i in range(64)}  # 256 MiB
    manifest = {k: weights.ParamSpec(tuple(v.shape), "F32") for k, v in tensors.items()}
    async with LoopLag() as lag:
        staged = await weights.validate_and_stage(tensors, manifest, torch.float32, tmp_path)
    staged.release()
    assert lag.worst < 0.05, f"event loop stalled for {lag.worst * 1000:.0f} ms"


async def test_supervised_engine_copies_before_the_pause_and_off_the_event_loop():
    inner = FakeEngine()
    supervised = SupervisedEngine(inner, factory=lambda: asyncio.sleep(0, FakeEngine()))
    tensors = {f"w{i}": torch.randn(1024, 1024) for i in range(64)}
    clock = VersionClock()
    sync = WeightSync(supervised, clock, SyncConfig())
    async with LoopLag() as lag:
        timing = await sync.publish(tensors)
    assert lag.worst < 0.05, f"event loop stalled for {lag.worst * 1000:.0f} ms"
    assert timing.total_s < 0.05, f"generation was paused {timing.total_s * 1000:.0f} ms"
    assert timing.prepare_s > timing.total_s, "the copy happens while generation still runs"


# -- 9. packaging says what the code needs -----------------------------------------------------------------------


def test_declared_python_and_dependencies_match_the_code():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11", "TaskGroup and except* need Python 3.11"
    sources = "".join(p.read_text() for p in (ROOT / "asyncrl").rglob("*.py"))
    for dep in project["dependencies"]:
        name = dep.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        module = {"tqdm": "tqdm", "safetensors": "safetensors"}.get(name, name)
        assert f"import {module}" in sources or f"from {module}" in sources, f"{name} is declared but never used"


# -- 10. the engines share one behaviour -----------------------------------------------------------------------


def test_an_unknown_finish_reason_is_an_error_for_every_engine():
    with pytest.raises(EngineError, match="unexpected finish reason 'error'"):
        finish_reason("x", "error")
    from asyncrl.engines.vllm_remote.streaming import SampleBuilder

    builder = SampleBuilder("remote", "r0", 0)
    builder.add({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "text": "a",
                              "finish_reason": "error"}]}, 0)
    with pytest.raises(EngineError, match="unexpected finish reason"):
        builder.build(clean_end=True)


async def test_restoring_after_a_failed_reload_retries_the_same_number_of_times_everywhere(tmp_path):
    calls = []

    async def flaky(path: Path) -> None:
        calls.append(path)
        if len(calls) < RESTORE_ATTEMPTS:
            raise RuntimeError("spoiled layer state")

    await restore_good_weights("e", flaky, tmp_path, RuntimeError("reload failed"))
    assert len(calls) == RESTORE_ATTEMPTS


async def test_the_file_transport_restores_the_last_good_weights_after_a_failed_reload(tmp_path):
    """Both vLLM engines reload files through ``FileTransport``: a reload that fails part-way is undone by
    reloading the last good directory, the update is refused, and the next good one becomes the restore point."""
    from safetensors.torch import save_file

    from asyncrl.engines.transports.base import check_carries
    from asyncrl.engines.transports.files import FileTransport
    from asyncrl.engines.updates import InMemory, WeightUpdate

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"w": torch.zeros(2)}, str(model_dir / "model.safetensors"))
    reloads: list[Path] = []
    failing: set[int] = {1}

    async def reload(path: Path) -> None:
        reloads.append(path)
        if len(reloads) in failing:
            raise RuntimeError("half the layers loaded")

    transport = FileTransport("e", reload, model_dir, torch.float32, root=tmp_path)
    bad = await transport.stage(WeightUpdate(1, InMemory({"w": torch.ones(2)})))
    with pytest.raises(weights.WeightUpdateError, match="previous weights restored"):
        await transport.load(bad)
    transport.release(bad)
    assert reloads == [bad.staged.path, model_dir]  # the checkpoint itself: nothing loaded before
    good = await transport.stage(WeightUpdate(2, InMemory({"w": torch.full((2,), 2.0)})))
    await transport.load(good)
    transport.release(good)
    assert transport.good == good.staged.path and good.staged.path.is_dir()  # kept as the restore point
    with pytest.raises(weights.WeightUpdateError, match="adapter"):  # what an engine asks before it stages
        check_carries("e", transport, WeightUpdate(3, AdapterWeights({}, LoraConfig())))
    await transport.close()
    assert not good.staged.path.exists()



async def test_a_non_finite_gradient_refuses_the_step_before_the_weights_change():
    class NanLoss(RecordingLoss):
        def compute(self, model, groups, **kw):
            out = super().compute(model, groups, **kw)
            return dataclasses.replace(out, loss=out.loss + model.weight.sum() * math.nan)

    pipe = grpo_pipeline(FakeEngine(), torch.nn.Linear(2, 2), prompts(50), RewardGroups(lambda p, s: 1.0), config(),
                         loss=NanLoss())
    before = {k: v.clone() for k, v in pipe.learner.model.state_dict().items()}
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        await pipe.run(steps=2)
    after = pipe.learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "no half-applied step"
    assert pipe.result.unaccounted == 0


# -- 8. a pipeline that ends, or is cancelled, leaves no learner thread behind -------------------------------


def _learner_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asyncrl-learner")}


@pytest.mark.parametrize("cancelled", [False, True])
async def test_a_pipeline_lets_its_learner_thread_go(cancelled: bool):
    before, during = _learner_threads(), set()
    stepped = asyncio.Event()

    def seen(step: int, metrics: dict[str, float]) -> None:
        during.update(_learner_threads() - before)
        stepped.set()

    pipe = grpo_pipeline(FakeEngine(token_delay_s=0.001), torch.nn.Linear(2, 2), prompts(1000),
                         RewardGroups(lambda p, s: 1.0),
                         config(), loss=RecordingLoss())
    pipe.learner.hooks.append(seen)
    run = asyncio.create_task(pipe.run(steps=None if cancelled else 2))
    if cancelled:
        await stepped.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    else:
        await run
    assert during, "the steps ran in a learner thread"
    assert not during & _learner_threads(), "the learner's thread outlived its pipeline"
