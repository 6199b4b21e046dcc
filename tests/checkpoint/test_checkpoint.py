"""Checkpoints on disk: the round trip of weights, optimiser, data position and RNG, pruning, and torn or corrupt
writes never loaded (resuming a run from one is in test_checkpoint_resume.py)."""

from __future__ import annotations

import logging
import random
import shutil

import numpy as np
import pytest
import torch

from asyncrl import (
    ConfigError, DropReason, FinishReason, Prompt, QueueConfig, Rollout, RolloutGroup, Sample, VersionClock,
    VersionSpan,
)
from asyncrl.queues import RolloutSender, create_rollout_queue
from asyncrl.actors.learner import Learner
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.checkpoint import (
    CheckpointConfig, Checkpointer, CorruptCheckpoint, latest, restore, save_learner, training_state, verify,
)
from asyncrl.checkpoint.store import MANIFEST_FILE
from asyncrl.config import SyncConfig
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.weights import WEIGHTS_FILE
from tests.support.checkpoint import script


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
    learner.counters.groups_trained = 4  # as if trained: the learner's books
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
        # the write runs in a thread, later
        await ckpt.start_save(learner.model, learner.optimizer, training_state(learner, await advanced_source(0)))
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
