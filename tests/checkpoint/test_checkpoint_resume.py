"""Resuming training from a checkpoint: the pipeline on a FakeEngine, kill -9 (also mid-write) of real
training processes, and a resume on the real vLLM engine."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl import LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig, VersionClock
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.checkpoint import CheckpointConfig, Checkpointer, latest, resume_pipeline
from asyncrl.checkpoint.store import MANIFEST_FILE
from asyncrl.config import SyncConfig
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.weights import WEIGHTS_FILE
from asyncrl.groups import RewardGroups
from tests.support.checkpoint import SCRIPT, script


def fake_config() -> PipelineConfig:
    return PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3)),
                          queue=QueueConfig(capacity=8, max_staleness=4), learner=LearnerConfig(batch_groups=2))


async def test_resume_pipeline_continues_step_version_data_and_books(tmp_path):
    data = script.make_items(500)
    ckpt_cfg = CheckpointConfig(tmp_path, every_steps=2, keep=2)
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, state = await resume_pipeline(FakeEngine(), torch.nn.Linear(4, 1), data, RewardGroups(script.reward),
                                            fake_config(),
                                            checkpoint=None, checkpointer=ckpt, loss=script.RegressionLoss())
        assert state is None
        await pipe.run(6)
    saved = latest(tmp_path)
    assert saved.step == 6 and saved.meta["version"] == 6

    engine = FakeEngine()
    model, loss = torch.nn.Linear(4, 1), script.RegressionLoss()
    async with Checkpointer(ckpt_cfg) as ckpt:
        pipe, state = await resume_pipeline(engine, model, data, RewardGroups(script.reward), fake_config(),
                                            checkpoint=saved,
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
    from asyncrl.testing.tasks import arithmetic
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
        pipe, _ = await resume_pipeline(vllm_engine, load_hf_model(tiny_model_dir), data, RewardGroups(reward), cfg,
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
        pipe, state = await resume_pipeline(vllm_engine, model, data, RewardGroups(reward), cfg, checkpoint=saved,
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
