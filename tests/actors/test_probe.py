"""The publication probe through the learner (fast, a fake engine that holds a real model): each publication is
checked against exactly the weights it published, in the foreground and with ``overlap``, for full weights and for
a LoRA adapter; an engine that goes on serving other weights fails the run loudly; a target that cannot be scored
says so. The real engines' side is in tests/lora/test_lora_publication.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from asyncrl import ConfigError, PipelineConfig, SyncConfig
from asyncrl.actors.probe import PublicationMismatch, policy_logprobs
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.updates import UpdateKind, WeightUpdate
from asyncrl.lora import LoraConfig, apply_lora, load_adapter_state
from asyncrl.recipes import grpo_pipeline
from asyncrl.groups import RewardGroups
from tests.support.algorithms import _model
from tests.support.pipelines import config, prompts


class ScoringFake(FakeEngine):
    """A fake engine that also holds a copy of the policy, loads what is published into it, and scores with it;
    ``stuck`` makes it keep the weights it had (the load lands, the weights do not change)."""

    def __init__(self, policy: torch.nn.Module, stuck: bool = False) -> None:
        super().__init__(vocab_size=50)
        self.model = copy.deepcopy(policy).eval()
        self.stuck = stuck

    async def load(self, update: WeightUpdate) -> None:
        await super().load(update)
        if self.stuck:
            return
        if update.source.kind is UpdateKind.ADAPTER:
            load_adapter_state(self.model, update.tensors)
        else:
            self.model.load_state_dict(dict(update.tensors))

    async def score(self, token_ids):
        return {self.name: policy_logprobs(self.model, token_ids)}


def probed(overlap: bool = False) -> PipelineConfig:
    base = config(batch=2, capacity=4)
    sync = SyncConfig(overlap=overlap, probe_tolerance=1e-5, probe_tokens=8)
    return dataclasses.replace(base, learner=dataclasses.replace(base.learner, lr=1e-2, sync=sync))


def policy(lora: bool) -> torch.nn.Module:
    model = _model().train()
    return apply_lora(model, LoraConfig(rank=4, alpha=8)) if lora else model


def reward(prompt, sample) -> float:
    return float(sample.token_ids[0] % 3)  # varies within a group, so the steps move the weights


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("overlap", [False, True], ids=["foreground", "overlap"])
async def test_every_publication_is_probed_against_what_it_published(lora, overlap):
    model = policy(lora)
    engine = ScoringFake(model)
    pipe = grpo_pipeline(engine, model, prompts(40, length=4), RewardGroups(reward), probed(overlap))
    await pipe.run(3)
    probe = pipe.learner.probe
    assert probe is not None and probe.checks == 3 and probe.last_diff is not None and probe.last_diff < 1e-5
    ids = probe._ids
    assert ids is not None and 2 <= len(ids) <= 8
    # The weights moved, so a probe against the start would have failed: the check compares the right weights.
    start = policy(lora)
    assert max(abs(a - b) for a, b in zip(policy_logprobs(start, ids), policy_logprobs(engine.model, ids))) > 1e-4


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_an_engine_serving_other_weights_fails_the_run(lora):
    model = policy(lora)
    pipe = grpo_pipeline(ScoringFake(model, stuck=True), model, prompts(40, length=4), RewardGroups(reward), probed())
    with pytest.raises(PublicationMismatch, match="serves other weights than were published"):
        await pipe.run(3)
    assert pipe.learner.step == 1  # the first publication was caught


async def test_a_target_that_cannot_be_scored_says_so():
    model = policy(False)
    pipe = grpo_pipeline(FakeEngine(vocab_size=50), model, prompts(40, length=4), RewardGroups(reward), probed())
    with pytest.raises(ConfigError, match="cannot score sequences"):
        await pipe.run(2)
