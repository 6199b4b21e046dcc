"""Multi-turn episodes on their way to the learner, on the in-memory FakeEngine: rewards, a pipeline trained on
episodes, the masked loss, and trajectories on the wire."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from asyncrl import LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig
from asyncrl.actors.producer import Producer
from asyncrl.algorithms import GRPOLoss, LossConfig, completion_logprobs
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.episodes import EpisodeGroups, model_token_ids, turn_slices
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import FinishReason, Rollout, RolloutGroup, Sample, Trajectory, VersionSpan
from tests.support.episodes import PROMPT, ScriptedEnv

# ------------------------------------------------------------------------------------------------ rewards + pipeline


async def test_rewards_are_the_environments_plus_a_trajectory_reward():
    sent = []

    class Sink:
        async def send(self, group, *, ticket=None):
            sent.append(group)
            return True

    cfg = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=2))
    reward = lambda prompt, trajectory: float(len(model_token_ids(trajectory)))  # noqa: E731
    producer = Producer(FakeEngine(), PromptSource([PROMPT]), EpisodeGroups(lambda p: ScriptedEnv(), reward), Sink(),
                        cfg)
    await producer.run()
    assert sent[0].rewards == (1.5 + 6.0, 1.5 + 6.0)
    with pytest.raises(TypeError, match="must be a GroupMaker"):
        Producer(FakeEngine(), PromptSource([PROMPT]), None, Sink(), cfg)


async def test_pipeline_trains_on_episodes_and_reports_episode_metrics():
    seen_masks = []

    class MaskLoss(GRPOLoss):
        min_group_size = 1

        def compute(self, model, groups, **kw):
            seen_masks.extend(r.sample.loss_mask for g in groups for r in g.rollouts)
            return super().compute(model, groups, **kw)

    model = TinyLM()
    config = PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3)),
                            queue=QueueConfig(capacity=4), learner=LearnerConfig(batch_groups=2,
                                                                                 skip_inert_groups=False))
    rows = []
    pipe = grpo_pipeline(FakeEngine(vocab_size=TinyLM.VOCAB), model, [PROMPT] * 8,
                         EpisodeGroups(lambda p: ScriptedEnv(turns=2)), config, loss=MaskLoss(LossConfig()))
    pipe.learner.hooks.append(lambda step, metrics: rows.append(dict(metrics)))
    result = await pipe.run(steps=2)
    assert result.steps == 2 and result.unaccounted == 0
    assert seen_masks and all(m == (1, 1, 1, 0, 0) * 2 for m in seen_masks)
    assert rows[0]["episode/turns_mean"] == 2.0 and rows[0]["episode/episodes"] >= 4
    assert rows[0]["episode/tool_call_rate"] == 0.0 and rows[-1]["episode/truncated_frac"] == 0.0


# ------------------------------------------------------------------------------------------------ loss


class TinyLM(torch.nn.Module):
    """A causal LM small enough to reason about: logits from an embedding of the token and its position."""

    VOCAB = 100

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(self.VOCAB, 16)
        self.pos = torch.nn.Embedding(64, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, self.VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.tok(input_ids) + self.pos(position_ids)
        h = torch.cumsum(self.mix(h), dim=1)  # each position sees itself and what comes before it: causal
        return type("Out", (), {"logits": self.head(torch.tanh(h))})()


def _group(samples: list[Sample], rewards: list[float]) -> RolloutGroup:
    return RolloutGroup("g", Prompt("p", (1, 2, 3)), tuple(Rollout(s, r) for s, r in zip(samples, rewards)))


def _traj(ids: tuple[int, ...], mask: tuple[int, ...], lp: float = -1.0) -> Trajectory:
    logprobs = tuple(lp if m else 0.0 for m in mask)
    bare = Trajectory(ids, logprobs, FinishReason.STOP, (VersionSpan(0, 0, 0),), loss_mask=mask)
    return replace(bare, version_spans=tuple(VersionSpan(0, a, b) for a, b in turn_slices(bare)))


def test_an_all_model_mask_gives_exactly_the_unmasked_numbers():
    model = TinyLM()
    ids = [(4, 5, 6, 7), (8, 9)]
    plain = completion_logprobs(model, [(1, 2)] * 2, ids, with_entropy=True)
    masked = completion_logprobs(model, [(1, 2)] * 2, ids, with_entropy=True, loss_masks=[(1,) * 4, None])
    assert torch.equal(plain.logprobs, masked.logprobs) and torch.equal(plain.mask, masked.mask)
    assert torch.equal(plain.entropy, masked.entropy)


def test_env_tokens_are_context_but_never_loss():
    model = TinyLM()
    mask = (1, 1, 0, 0, 1, 1)
    a = _traj((4, 5, 60, 61, 6, 7), mask)
    b = replace(_traj((4, 5, 70, 71, 6, 7), mask), logprobs=a.logprobs)
    out = completion_logprobs(model, [(1, 2, 3)] * 2, [a.token_ids, b.token_ids], loss_masks=[mask, mask])
    assert out.mask[0].tolist() == [1, 1, 0, 0, 1, 1] and (out.logprobs[:, 2:4] == 0).all()
    assert not torch.equal(out.logprobs[0, 4:], out.logprobs[1, 4:]), "tokens after the env's see its ids"
    loss = GRPOLoss(LossConfig(is_level="sequence"))
    group = _group([a, _traj((4, 9, 60, 61, 6, 7), mask)], [1.0, 0.0])
    result = loss.compute(model, [group])
    assert result.num_tokens == 8 == group.num_tokens
    # The behaviour log-prob at an env position is not used: any value there gives the same loss.
    odd = replace(a, logprobs=(-1.0, -1.0, -9.0, -9.0, -1.0, -1.0))
    again = loss.compute(model, [_group([odd, group.rollouts[1].sample], [1.0, 0.0])])
    assert torch.equal(result.loss, again.loss)


def test_masked_loss_equals_the_loss_of_the_model_tokens_scored_in_context():
    """Per-token terms of a trajectory are those of its model tokens, each scored after the full context."""
    model = TinyLM()
    mask = (1, 1, 0, 1)
    t1, t2 = _traj((4, 5, 60, 6), mask, lp=-4.0), _traj((7, 8, 61, 9), mask, lp=-5.0)
    cfg = LossConfig(length_norm="token_mean")
    got = GRPOLoss(cfg).compute(model, [_group([t1, t2], [1.0, 0.0])]).loss
    out = completion_logprobs(model, [(1, 2, 3)] * 2, [t1.token_ids, t2.token_ids])
    keep = torch.tensor([mask, mask], dtype=torch.float32)
    behaviour = torch.tensor([t1.logprobs, t2.logprobs])
    weight = torch.exp(out.logprobs.detach() - behaviour).clamp(max=2.0)
    terms = -weight * torch.tensor([[1.0], [-1.0]])  # advantages +-1, ratio 1
    torch.testing.assert_close(got, (terms * keep).sum() / keep.sum())


# ------------------------------------------------------------------------------------------------ wire


def _wire_group() -> RolloutGroup:
    t = Trajectory((4, 5, 60, 61, 6), (-1.0, -2.0, 0.0, 0.0, -3.0), FinishReason.STOP,
                   (VersionSpan(2, 0, 1), VersionSpan(3, 1, 2), VersionSpan(3, 4, 5)), "ab|c", (1, 1, 0, 0, 1))
    plain = Sample(t.token_ids, (-1.0,) * 5, FinishReason.STOP, (VersionSpan(3, 0, 5),))
    return _group([t, plain], [1.0, 0.0])


def test_wire_round_trips_a_trajectory_exactly():
    group = _wire_group()
    obj = json.loads(json.dumps(group_to_json(group)))
    assert obj["rollouts"][0]["sample"]["loss_mask"] == [1, 1, 0, 0, 1]
    assert obj["rollouts"][1]["sample"]["loss_mask"] is None
    back = group_from_json(obj)
    assert back == group and group.staleness(5) == 3
    assert type(back.rollouts[0].sample) is Trajectory and type(back.rollouts[1].sample) is Sample


def _sample0(obj):
    return obj["rollouts"][0]["sample"]


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.__setitem__("loss_mask", [1, 1, 0, 0]), "loss_mask: length 4 != token_ids length 5"),
    (lambda s: s["loss_mask"].__setitem__(2, 2), "loss_mask[2]: must be 0 or 1, got 2"),
    (lambda s: s["loss_mask"].__setitem__(2, False), "loss_mask[2]: must be 0 or 1, got False"),
    (lambda s: s["logprobs"].__setitem__(3, -0.5), "logprobs[3]: -0.5 at an environment token"),
    (lambda s: s["version_spans"][2].update(start=3), "version_spans[2].start: 3 != 4"),
    (lambda s: s["version_spans"][1].update(end=3), "version_spans[1].end: 3 > 2: the span covers environment"),
    (lambda s: s["version_spans"].pop(), "version_spans: model tokens from 4 on are not covered"),
    (lambda s: s["version_spans"].append({"version": 3, "start": 5, "end": 6}), "version_spans[3]: covers no"),
    (lambda s: s["version_spans"][2].update(version=1), "version_spans[2].version: 1 < previous span's 3"),
    (lambda s: s.pop("loss_mask"), "loss_mask: missing"),
])
def test_wire_refuses_malformed_trajectories(mutate, message):
    obj = group_to_json(_wire_group())
    mutate(_sample0(obj))
    with pytest.raises(WireError) as info:
        group_from_json(obj)
    assert f"rollouts[0].sample.{message}" in str(info.value)


def test_wire_carries_a_trajectory_without_model_tokens_as_one_empty_span():
    t = Trajectory((60, 61), (0.0, 0.0), FinishReason.LENGTH, (VersionSpan(2, 0, 0),), loss_mask=(0, 0))
    group = _group([t], [0.0])
    assert group_from_json(group_to_json(group)) == group
