"""Checkpoint and resume: round trip, pruning, torn writes never loaded, kill -9 (also mid-write) with real
processes, and a resume on the real vLLM engine."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl import (
    ConfigError, DropReason, FinishReason, LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, Rollout,
    RolloutGroup, RolloutSender, Sample, SamplingConfig, VersionClock, VersionSpan, create_rollout_queue,
)
from asyncrl.actors.learner import Learner
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.checkpoint import (
    CheckpointConfig, Checkpointer, CorruptCheckpoint, latest, restore, resume_pipeline, save_learner, training_state,
    verify,
)
from asyncrl.checkpoint.store import MANIFEST_FILE
from asyncrl.config import SyncConfig
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.weights import WEIGHTS_FILE

SCRIPT = Path(__file__).parent / "scripts" / "train_with_checkpoints.py"
_spec = importlib.util.spec_from_file_location("train_with_checkpoints", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def items(count: int = 100) -> list[Prompt]:
    return [Prompt(f"p{i}", (1, 2, 3)) for i in range(count)]


def group(gid: str) -> RolloutGroup:
    r = Rollout(Sample((2,), (-1.0,), FinishReason.STOP, (VersionSpan(0, 0, 1),)), 1.0)
    return RolloutGroup(gid, Prompt(gid, (1,)), (r,))


def make_learner(step: int = 0, version: int = 0) -> tuple[Learner, RolloutSender]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()  # the optimiser has state worth saving
    clock = VersionClock(version)
    sender, receiver = create_rollout_queue(QueueConfig(capacity=8, max_staleness=100), clock)
    learner = Learner(model, optimizer, script.RegressionLoss(), receiver, WeightSync(FakeEngine(), clock,
                                                                                      SyncConfig()), step=step)
    return learner, sender


def _parts(learner: Learner, source: PromptSource, extra: dict) -> tuple:
    return learner.model, learner.optimizer, training_state(learner, source, extra)


async def advanced_source(count: int) -> PromptSource:
    source = PromptSource(items())
    for _ in range(count):
        await source.next()
    return source


def same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa["param_groups"] == sb["param_groups"] and all(
        torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])


@pytest.mark.parametrize("kwargs, name", [
    (dict(dir="x", every_steps=0), "CheckpointConfig.every_steps"),
    (dict(dir="x", keep=0), "CheckpointConfig.keep"),
    (dict(dir="x", keep=True), "CheckpointConfig.keep"),
    (dict(dir=""), "CheckpointConfig.dir"),
])
def test_bad_config_names_the_field(kwargs, name):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(**kwargs)
    assert err.value.field == name


async def test_round_trip_restores_weights_optimizer_position_and_rng(tmp_path):
    learner, sender = make_learner(step=5, version=4)
    source = await advanced_source(7)
    for i in range(6):  # prompts 0-5 became groups, 4 trained, 2 still queued; prompt 6 is in flight
        await sender.send(group(f"p{i}#{i}"))
    await learner.receiver.receive_batch(4)
    learner.receiver.counters.trained = 4
    async with Checkpointer(CheckpointConfig(tmp_path, every_steps=1)) as ckpt:
        saved = await save_learner(ckpt, learner, source, extra={"note": "hi"})
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = restore(latest(tmp_path), model, optimizer)

    assert saved.step == state.step == 5 and state.version == 4 and state.cursor == 7 and state.published
    assert state.extra == {"note": "hi"}
    assert all(torch.equal(model.state_dict()[k], w) for k, w in weights.items())
    assert same_optimizer_state(optimizer, learner.optimizer)
    assert state.counters.queued == 6 and state.counters.trained == 4
    assert state.counters.dropped[DropReason.UNUSED_AT_SHUTDOWN] == 3, "queued and in-flight groups are lost"
    assert state.counters.unaccounted(0) == 0, "... and counted, so the books balance"


async def test_next_random_numbers_after_restore_equal_those_after_save(tmp_path):
    learner, _ = make_learner()
    async with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        await save_learner(ckpt, learner, await advanced_source(0))
    expected = torch.rand(4), random.random(), float(np.random.rand())
    torch.rand(50), random.random(), np.random.rand(3)
    restore(latest(tmp_path), torch.nn.Linear(4, 3))
    got = torch.rand(4), random.random(), float(np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


async def test_snapshot_is_taken_before_the_next_step_can_change_the_weights(tmp_path):
    learner, _ = make_learner(step=1)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in learner.optimizer.state_dict()["state"][0].items()}
    async with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        await ckpt.start_save(learner.model, learner.optimizer, training_state(learner, await advanced_source(0)))  # the write runs in a thread, later
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(1.0)  # "the next optimiser step"
        learner.model(torch.randn(5, 4)).sum().backward()
        learner.optimizer.step()
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restore(latest(tmp_path), model, optimizer)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(optimizer.state_dict()["state"][0][k], v) for k, v in opt_before.items())


async def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    learner, _ = make_learner()
    learner.model = Tied()
    learner.optimizer = torch.optim.AdamW(learner.model.parameters())
    async with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        saved = await save_learner(ckpt, learner, await advanced_source(0))
    assert saved.meta["aliases"] == {"head.weight": "embed.weight"}
    fresh = Tied()
    restore(saved, fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, learner.model.embed.weight)


async def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    learner, _ = make_learner()
    source = await advanced_source(0)
    (tmp_path / ".tmp-step-000099-dead").mkdir(parents=True)  # left by a killed writer
    async with Checkpointer(CheckpointConfig(tmp_path, keep=2)) as ckpt:
        for step in range(1, 6):
            learner.step = step
            await save_learner(ckpt, learner, source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005"]
    assert latest(tmp_path).step == 5


async def test_saving_a_step_again_replaces_it(tmp_path):
    learner, _ = make_learner(step=3)
    async with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        await save_learner(ckpt, learner, await advanced_source(1))
        with torch.no_grad():
            learner.model.weight.add_(1.0)
        await save_learner(ckpt, learner, await advanced_source(2))  # e.g. a run resumed from an older checkpoint
    model = torch.nn.Linear(4, 3)
    assert restore(latest(tmp_path), model).cursor == 2
    assert torch.equal(model.weight, learner.model.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000003"]


async def test_extra_that_is_not_json_fails_the_save_call(tmp_path):
    async with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        with pytest.raises(TypeError):
            await ckpt.start_save(*_parts(make_learner()[0], await advanced_source(0), extra={"x": object()}))
    assert latest(tmp_path) is None


async def test_torn_or_corrupt_checkpoints_are_never_returned(tmp_path, caplog):
    learner, _ = make_learner()
    source = await advanced_source(0)
    async with Checkpointer(CheckpointConfig(tmp_path, keep=10)) as ckpt:
        for step in (1, 2, 3, 5, 6):
            learner.step = step
            await save_learner(ckpt, learner, source)
    torn = tmp_path / ".tmp-step-000007-abc"  # a write killed before its rename
    shutil.copytree(tmp_path / "step-000006", torn)
    (tmp_path / "step-000005" / MANIFEST_FILE).unlink()  # no COMPLETE manifest
    weights = tmp_path / "step-000006" / WEIGHTS_FILE  # a flipped byte
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="asyncrl.checkpoint"):
        found = latest(tmp_path)
    assert found is not None and found.step == 3
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert torn.name in warnings
    assert "step-000005" in warnings and "no COMPLETE" in warnings
    assert "step-000006" in warnings and "checksum" in warnings
    for bad in ("step-000005", "step-000006"):
        with pytest.raises(CorruptCheckpoint):
            verify(tmp_path / bad)
    with pytest.raises(CorruptCheckpoint):
        restore(tmp_path / "step-000006", torch.nn.Linear(4, 3))
    assert latest(tmp_path / "missing") is None


def fake_config() -> PipelineConfig:
    return PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3)),
                          queue=QueueConfig(capacity=8, max_staleness=4), learner=LearnerConfig(batch_groups=2))


async def test_resume_pipeline_continues_step_version_data_and_books(tmp_path):
    data = script.make_items(500)
    ckpt_cfg = CheckpointConfig(tmp_path, every_steps=2, keep=2)
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, state = await resume_pipeline(FakeEngine(), torch.nn.Linear(4, 1), data, script.reward, fake_config(),
                                            checkpoint=None, checkpointer=ckpt, loss=script.RegressionLoss())
        assert state is None
        await pipe.run(6)
    saved = latest(tmp_path)
    assert saved.step == 6 and saved.meta["version"] == 6

    engine = FakeEngine()
    model, loss = torch.nn.Linear(4, 1), script.RegressionLoss()
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, state = await resume_pipeline(engine, model, data, script.reward, fake_config(), checkpoint=saved,
                                            checkpointer=ckpt, loss=loss)
        assert engine.version == pipe.learner.version == 6
        assert all(torch.equal(engine.weights[k], v) for k, v in model.state_dict().items())
        stats = await pipe.run(10)
    assert stats.steps == 10 and stats.version == 10
    assert min(loss.trained) >= saved.meta["cursor"], "no prompt before the cursor is trained again"
    assert stats.unaccounted == 0, "the restored books balance"
    assert stats.groups_trained == 20
    assert latest(tmp_path).step == 10


# ---- kill -9 with real processes ---------------------------------------------------------------------------


class ScriptRun:
    """The training script in a subprocess; its stdout JSON lines read by a thread, awaited with deadlines."""

    def __init__(self, tmp_path: Path, tag: str, *args: object) -> None:
        self.stderr_path = tmp_path / f"{tag}.stderr"
        with self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], stdout=subprocess.PIPE,
                                         stderr=err, text=True, cwd=tmp_path)
        self.events: list[dict] = []
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def until(self, predicate, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no matching line within {timeout_s}s; stderr:\n{self.stderr()}") from None
            if event is None:
                raise AssertionError(f"script ended (rc {self.proc.wait()}) first; stderr:\n{self.stderr()}")
            self.events.append(event)
            if predicate(event):
                return event

    def finish(self, timeout_s: float) -> list[dict]:
        try:
            self.until(lambda e: False, timeout_s)
        except AssertionError as end:
            if "script ended" not in str(end):
                raise
        assert self.proc.wait(10) == 0, self.stderr()
        return self.events

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(10) == -signal.SIGKILL
        self._drain()

    def _drain(self) -> None:
        while (event := self._lines.get(timeout=10)) is not None:
            self.events.append(event)

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-4000:]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def file_digest(checkpoint_dir: Path) -> str:
    from safetensors.torch import load_file

    return script.digest(load_file(str(checkpoint_dir / WEIGHTS_FILE)))


def check_resumed_run(resumed: ScriptRun, killed: ScriptRun, reference: ScriptRun, checkpoint, weights: str,
                      target: int) -> None:
    """Resumed at ``checkpoint`` (whose weights file has digest ``weights``) with its weights, and the data
    order continues from its cursor."""
    step, cursor = checkpoint.step, checkpoint.meta["cursor"]
    [info] = resumed.of("resumed")
    killed_digest = {e["step"]: e["digest"] for e in killed.of("step")}[step]
    assert info["step"] == step and info["cursor"] == cursor and info["version"] == checkpoint.meta["version"]
    assert info["digest"] == weights == killed_digest, "restored weights = the checkpoint's"
    assert info["engine_version"] == info["version"] and info["engine_digest"] == info["digest"], \
        "the restored weights were published to the engine under the restored version"
    assert [e["step"] for e in resumed.of("step")] == list(range(step + 1, target + 1))
    [done] = resumed.of("done")
    assert done["steps"] == target and done["unaccounted"] == 0

    ref_ids = {e["index"]: e["id"] for e in reference.of("handout")}
    handed = [(e["index"], e["id"]) for e in resumed.of("handout")]
    assert [i for i, _ in handed] == list(range(cursor, cursor + len(handed))), "continues at the cursor"
    assert handed[-1][0] in ref_ids, "the reference run must hand out at least as far"
    assert [pid for _, pid in handed] == [ref_ids[i] for i, _ in handed], "same data order as a never-killed run"
    trained = [i for e in resumed.of("step") for i in e["trained"]]
    assert min(trained) >= cursor, "nothing before the cursor is trained again"
    ref_trained = [i for e in reference.of("step") for i in e["trained"] if i >= cursor]
    assert trained == ref_trained[: len(trained)], "post-cursor training order matches the never-killed run"


def reference_run(tmp_path: Path, cursor: int, resumed_steps: int) -> ScriptRun:
    steps = cursor // 2 + resumed_steps + 4  # trains 2 prompts per step: reaches past cursor + resumed work
    run = ScriptRun(tmp_path, "reference", "--dir", tmp_path / "ref", "--steps", steps)
    run.finish(120)
    return run


def test_kill_9_resumes_from_the_last_complete_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    killed = ScriptRun(tmp_path, "killed", "--dir", ckpt_dir, "--steps", 1_000_000)
    killed.until(lambda e: e["event"] == "saved" and e["step"] >= 3, 120)
    killed.kill()
    checkpoint = latest(ckpt_dir)
    assert checkpoint is not None and checkpoint.step >= 3
    weights = file_digest(checkpoint.path)
    target = checkpoint.step + 5
    resumed = ScriptRun(tmp_path, "resumed", "--dir", ckpt_dir, "--steps", target, "--resume")
    resumed.finish(120)
    reference = reference_run(tmp_path, checkpoint.meta["cursor"], 5)
    check_resumed_run(resumed, killed, reference, checkpoint, weights, target)
    assert latest(ckpt_dir).step == target


def test_kill_9_during_a_checkpoint_write_leaves_it_ignored(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    killed = ScriptRun(tmp_path, "killed", "--dir", ckpt_dir, "--steps", 1_000_000, "--pause-write-at", 5)
    paused = killed.until(lambda e: e["event"] == "write-paused", 120)
    torn = Path(paused["tmp"])
    assert (torn / WEIGHTS_FILE).is_file() and not (torn / MANIFEST_FILE).exists(), "killed mid-write"
    killed.kill()
    assert torn.is_dir() and not (ckpt_dir / "step-000005").exists()
    checkpoint = latest(ckpt_dir)
    assert checkpoint.step == 4, "the torn step-5 write is ignored"
    weights = file_digest(checkpoint.path)

    resumed = ScriptRun(tmp_path, "resumed", "--dir", ckpt_dir, "--steps", 9, "--resume")
    resumed.finish(120)
    assert f"ignoring unfinished checkpoint write {torn}" in resumed.stderr()
    reference = reference_run(tmp_path, checkpoint.meta["cursor"], 5)
    check_resumed_run(resumed, killed, reference, checkpoint, weights, 9)
    assert not torn.exists(), "the torn write was cleaned up by the next save"
    assert [e["step"] for e in resumed.of("saved")] == [5, 6, 7, 8, 9]
    assert latest(ckpt_dir).step == 9


# ---- the real engine ---------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_resume_on_the_real_engine_publishes_the_restored_weights(vllm_engine, tiny_model_dir, tokenizer,
                                                                        tmp_path):
    from asyncrl.algorithms.logprobs import completion_logprobs
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.tasks import arithmetic
    from tests.support import load_hf_model

    train, _ = arithmetic.split(500, 0)
    data = [Prompt(f"q{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer) for i, p in enumerate(train)]

    def reward(prompt, sample):  # varies within a group (an untrained model scores 0 everywhere): weights move
        return float(sum(sample.token_ids) % 2)

    cfg = PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6)),
                         queue=QueueConfig(capacity=8, max_staleness=1),
                         learner=LearnerConfig(batch_groups=2, lr=1e-3))
    ckpt_cfg = CheckpointConfig(tmp_path, every_steps=1, keep=2)
    kw = dict(pad_id=tokenizer.pad_token_id, close_engine=False)
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, _ = await resume_pipeline(vllm_engine, load_hf_model(tiny_model_dir), data, reward, cfg,
                                        checkpoint=None, checkpointer=ckpt, **kw)
        start = pipe.learner.version  # the session engine may have synced before
        await pipe.run(2)
    saved = latest(tmp_path)
    assert saved.step == 2 and saved.meta["version"] == start + 2

    base = load_hf_model(tiny_model_dir)  # a restarted engine: base weights, version 0
    await WeightSync(vllm_engine, VersionClock(vllm_engine.version), SyncConfig()).publish(state_dict_for_engine(base))
    await vllm_engine._set_version(0)  # versions never go back, except in an engine started afresh
    model = load_hf_model(tiny_model_dir)
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, state = await resume_pipeline(vllm_engine, model, data, reward, cfg, checkpoint=saved,
                                            checkpointer=ckpt, **kw)
        assert state.step == 2 and vllm_engine.version == pipe.learner.version == start + 2

        prompt = data[0].token_ids
        samples = await vllm_engine.generate(prompt, SamplingConfig(n=8, max_tokens=12, ignore_eos=True),
                                             request_id="ckpt-parity")

        def max_diff(m) -> float:
            with torch.no_grad():
                out = completion_logprobs(m, [prompt] * len(samples), [s.token_ids for s in samples])
            return max(float((out.logprobs[i, : len(s.token_ids)] - torch.tensor(s.logprobs)).abs().max())
                       for i, s in enumerate(samples))

        assert max_diff(model) < 2e-3, "the engine samples with the restored weights"
        assert max_diff(base) > 2e-3, "the check can tell restored weights from the base weights"
        stats = await pipe.run(3)
    assert stats.steps == 3 and vllm_engine.version == start + 3 and stats.unaccounted == 0
