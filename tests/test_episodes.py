"""Multi-turn episodes on the in-memory FakeEngine: trajectories, limits, drops, pauses, rewards, the wire
format and the masked loss (the real engine is in test_episodes_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import pytest
import torch

from asyncrl import (
    AbortPolicy, DropReason, EpisodeConfig, GroupCounters, LearnerConfig, PipelineConfig, ProducerConfig, Prompt,
    QueueConfig, RolloutDropped, SamplingConfig, StepResult, ToolBox, ToolCall, ToolEnv,
)
from asyncrl.actors.producer import Producer
from asyncrl.algorithms import GRPOLoss, LossConfig, completion_logprobs
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.episodes import EpisodeRunner, TrajectoryBuilder, model_token_ids, turn_slices
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import FinishReason, PauseMode, Rollout, RolloutGroup, Sample, Trajectory, VersionSpan

PROMPT = Prompt("p0", (1, 2, 3), answer=7)
ENV_IDS = (97, 98)


class ScriptedEnv:
    """Appends ``ENV_IDS`` after every turn, rewards 0.5 per step, done after ``turns`` steps; records calls."""

    def __init__(self, turns: int = 3, ids: tuple[int, ...] = ENV_IDS) -> None:
        self.turns, self.ids = turns, ids
        self.seen: list[tuple[int, ...]] = []
        self.closed = 0

    async def step(self, turn: Sample) -> StepResult:
        self.seen.append(turn.token_ids)
        return StepResult(self.ids, reward=0.5, done=len(self.seen) == self.turns, text="|")

    async def close(self) -> None:
        self.closed += 1


def runner(engine=None, env=None, *, n=1, max_tokens=4, **episode) -> tuple[EpisodeRunner, list[ScriptedEnv]]:
    made: list[ScriptedEnv] = []

    def factory(prompt: Prompt) -> ScriptedEnv:
        made.append(env() if env else ScriptedEnv())
        return made[-1]

    cfg = ProducerConfig(sampling=SamplingConfig(n=n, max_tokens=max_tokens),
                         episode=EpisodeConfig(**{"max_turns": 4, **episode}))
    return EpisodeRunner(engine or FakeEngine(), factory, cfg), made


# ------------------------------------------------------------------------------------------------ trajectories


async def test_trajectory_is_the_turns_and_env_ids_concatenated_with_a_mask():
    r, envs = runner()
    episode = await r.run(PROMPT, "e")
    t = episode.trajectory
    assert episode.turns == 3 and t.finish_reason is FinishReason.STOP and episode.env_reward == 1.5
    assert t.loss_mask == (1, 1, 1, 1, 0, 0) * 3
    assert turn_slices(t) == [(0, 4), (6, 10), (12, 16)]
    assert model_token_ids(t) == sum(envs[0].seen, ())  # what the env saw is what is trained
    assert [t.token_ids[i] for i, m in enumerate(t.loss_mask) if not m] == list(ENV_IDS * 3)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
    assert t.version_spans == (VersionSpan(0, 0, 4), VersionSpan(0, 6, 10), VersionSpan(0, 12, 16))
    assert t.num_model_tokens == 12 and t.text.count("|") == 3
    assert envs[0].closed == 1


async def test_each_turn_is_sampled_from_the_whole_context():
    seen: list[tuple[int, ...]] = []
    engine = FakeEngine()
    generate = engine.generate

    async def spy(prompt_ids, params, request_id, n=None):
        seen.append(prompt_ids)
        return await generate(prompt_ids, params, request_id, n)

    engine.generate = spy  # type: ignore[method-assign]
    r, _ = runner(engine)
    t = (await r.run(PROMPT, "e")).trajectory
    starts = [s for s, _ in turn_slices(t)]
    assert seen == [PROMPT.token_ids + t.token_ids[:s] for s in starts]


def test_step_results_are_checked():
    assert StepResult([1, 2]).token_ids == (1, 2)
    for bad in ({"token_ids": (1, -2)}, {"token_ids": ("a",)}, {"reward": math.nan}, {"reward": True},
                {"tool_calls": 1, "tool_errors": 2}, {"tool_calls": -1}):
        with pytest.raises(ValueError):
            StepResult(**bad)


def test_builder_keeps_the_requested_version_of_an_episode_without_model_tokens():
    b = TrajectoryBuilder()
    b.add_turn(Sample((), (), FinishReason.ABORT, (VersionSpan(4, 0, 0),)))  # a turn with no tokens
    assert b.build(FinishReason.LENGTH).version_spans == (VersionSpan(4, 0, 0),)


# ------------------------------------------------------------------------------------------------ limits


async def test_max_turns_ends_the_episode_as_length():
    r, _ = runner(env=lambda: ScriptedEnv(turns=10), max_turns=2)
    episode = await r.run(PROMPT, "e")
    assert episode.turns == 2 and episode.trajectory.finish_reason is FinishReason.LENGTH
    assert r.counters.truncated == 1


async def test_episode_token_budget_caps_turns_and_never_cuts_env_ids():
    # budget 11: turn 4 + env 2 + turn 4 (capped from 4 by room 5) -> 10; env's 2 ids do not fit in 1: not appended
    r, _ = runner(env=lambda: ScriptedEnv(turns=10), max_episode_tokens=11)
    t = (await r.run(PROMPT, "e")).trajectory
    assert t.loss_mask == (1, 1, 1, 1, 0, 0, 1, 1, 1, 1) and t.finish_reason is FinishReason.LENGTH
    r, _ = runner(env=lambda: ScriptedEnv(turns=10), max_episode_tokens=9)
    t = (await r.run(PROMPT, "e")).trajectory
    assert t.loss_mask == (1, 1, 1, 1, 0, 0, 1, 1, 1), "the second turn gets only the 3 tokens left"


async def test_the_engine_context_caps_the_episode():
    r, _ = runner(FakeEngine(max_model_len=12), env=lambda: ScriptedEnv(turns=10))
    t = (await r.run(PROMPT, "e")).trajectory  # 12 - 3 prompt tokens = 9 tokens of room
    assert len(t.token_ids) == 9 and t.finish_reason is FinishReason.LENGTH


async def test_stop_token_ids_end_a_turn_and_stay_in_it():
    engine = FakeEngine()
    r, envs = runner(engine, max_tokens=8)
    r.config = replace(r.config, sampling=replace(r.config.sampling, stop_token_ids=(8,)))
    t = (await r.run(PROMPT, "e")).trajectory  # the first turn is 6, 7, 8: stopped by 8, which it keeps
    assert envs[0].seen[0] == (6, 7, 8)
    assert turn_slices(t)[0] == (0, 3)


# ------------------------------------------------------------------------------------------------ drops


class RaisingEnv(ScriptedEnv):
    async def step(self, turn: Sample) -> StepResult:
        if self.seen:
            raise RuntimeError("sandbox crashed")
        return await super().step(turn)


class HangingEnv(ScriptedEnv):
    async def step(self, turn: Sample) -> StepResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class FloodingEnv(ScriptedEnv):
    async def step(self, turn: Sample) -> StepResult:
        return StepResult(tuple(range(50)))


class WrongTypeEnv(ScriptedEnv):
    async def step(self, turn: Sample) -> StepResult:
        return (1, 2)  # type: ignore[return-value]


@pytest.mark.parametrize("env, reason", [
    (RaisingEnv, DropReason.ENV_ERROR), (HangingEnv, DropReason.ENV_TIMEOUT),
    (FloodingEnv, DropReason.ENV_OUTPUT_TOO_LONG), (WrongTypeEnv, DropReason.ENV_ERROR),
])
async def test_failing_environments_drop_the_group_with_a_reason_and_are_closed(env, reason):
    r, envs = runner(env=env, n=3, env_timeout_s=0.2, max_env_tokens=16)
    async with asyncio.timeout(10):
        with pytest.raises(RolloutDropped) as info:
            await r.run_group("g", PROMPT)
    assert info.value.reason is reason
    assert [e.closed for e in envs] == [1] * len(envs), "every environment is closed, the failed one too"


async def test_a_factory_that_raises_is_an_env_error():
    def factory(prompt):
        raise KeyError("no such task")

    r = EpisodeRunner(FakeEngine(), factory, ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=2)))
    with pytest.raises(RolloutDropped) as info:
        await r.run_group("g", PROMPT)
    assert info.value.reason is DropReason.ENV_ERROR and "no such task" in str(info.value)


async def test_a_failed_group_cancels_its_other_episodes_engine_requests():
    engine = FakeEngine(token_delay_s=0.01)
    made: list[ScriptedEnv] = []

    def factory(prompt):  # the first episode fails at once, the others would run for seconds
        made.append(RaisingEnv(turns=10) if not made else ScriptedEnv(turns=10))
        return made[-1]

    cfg = ProducerConfig(sampling=SamplingConfig(n=3, max_tokens=2))
    r = EpisodeRunner(engine, factory, replace(cfg, episode=EpisodeConfig(max_turns=10)))
    async with asyncio.timeout(5):
        with pytest.raises(RolloutDropped):
            await r.run_group("g", PROMPT)
    assert engine._inflight == 0 and all(e.closed == 1 for e in made)


async def test_producer_counts_episode_drops_and_keeps_going():
    counters = GroupCounters()
    sent = []

    class Sink:
        async def send(self, group):
            sent.append(group)
            return True

    prompts = PromptSource([PROMPT, replace(PROMPT, prompt_id="p1")])
    calls = iter([FloodingEnv(), FloodingEnv(), ScriptedEnv(), ScriptedEnv()])
    cfg = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=2), episode=EpisodeConfig(max_env_tokens=8))
    producer = Producer(FakeEngine(), prompts, None, Sink(), cfg, group_counters=counters, env=lambda p: next(calls))
    await producer.run()
    assert counters.dropped == {DropReason.ENV_OUTPUT_TOO_LONG: 1} and len(sent) == 1
    assert producer.metrics()["episode/episodes"] == 2


# ------------------------------------------------------------------------------------------------ tools


async def test_tools_are_async_functions_with_timeouts_and_counted_errors():
    async def add(a: str, b: str) -> int:
        return int(a) + int(b)

    async def slow() -> None:
        await asyncio.Event().wait()

    box = ToolBox([add, slow], timeout_s=0.2)
    assert (await box.call(ToolCall("add", ("2", "3")))).output == "5"
    bad = await box.call(ToolCall("add", ("2", "x")))
    assert not bad.ok and bad.output.startswith("ValueError")
    assert not (await box.call(ToolCall("nope"))).ok
    with pytest.raises(RolloutDropped) as info:
        await box.call(ToolCall("slow"))
    assert info.value.reason is DropReason.TOOL_TIMEOUT
    with pytest.raises(TypeError):
        ToolBox([lambda: 1])


async def test_tool_env_calls_tools_then_scores_the_answer():
    async def double(x: object) -> int:
        return 2 * int(x)  # type: ignore[call-overload]

    calls = iter([ToolCall("double", (21,)), ToolCall("double", ("a",)), None])
    env = ToolEnv(ToolBox([double]), parse=lambda turn: next(calls),
                  render=lambda result: ((50, 51) if result.ok else (52,), result.output),
                  score=lambda turn: 1.0)
    r, _ = runner(env=lambda: env, n=1)
    episode = await r.run(PROMPT, "e")
    assert (episode.tool_calls, episode.tool_errors, episode.turns, episode.env_reward) == (2, 1, 3, 1.0)
    assert "42" in episode.trajectory.text and "ValueError" in episode.trajectory.text


async def test_a_hung_tool_drops_the_group_as_tool_timeout():
    async def hang() -> None:
        await asyncio.Event().wait()

    env = ToolEnv(ToolBox([hang], timeout_s=0.1), parse=lambda turn: ToolCall("hang"), render=lambda r: ((), ""))
    r, _ = runner(env=lambda: env, n=2)
    with pytest.raises(RolloutDropped) as info:
        await r.run_group("g", PROMPT)
    assert info.value.reason is DropReason.TOOL_TIMEOUT


# ------------------------------------------------------------------------------------------------ pauses


async def _pause_in_second_turn(engine: FakeEngine, mode: PauseMode, **producer) -> tuple[object, EpisodeRunner]:
    """Run an episode of three 6-token turns; pause in the middle of the second one, load version 1, resume."""
    second = asyncio.Event()
    generate = engine.generate

    async def spy(prompt_ids, params, request_id, n=None):
        if "/t1" in request_id:
            second.set()
        return await generate(prompt_ids, params, request_id, n)

    engine.generate = spy  # type: ignore[method-assign]
    cfg = ProducerConfig(sampling=SamplingConfig(n=1, max_tokens=6), episode=EpisodeConfig(max_turns=3), **producer)
    r = EpisodeRunner(engine, lambda p: ScriptedEnv(turns=3), cfg)
    task = asyncio.create_task(r.run(PROMPT, "e"))
    await second.wait()
    engine.token_produced.clear()
    await engine.token_produced.wait()  # the second turn is running
    await engine.pause(mode, clear_cache=True)
    engine._version = 1  # a weight load, as far as versions go
    await engine.resume()
    return await asyncio.wait_for(task, 10), r


def _turn_versions(t: Sample) -> list[list[int]]:
    return [[s.version for s in t.version_spans if a <= s.start < b] for a, b in turn_slices(t)]


async def test_keep_pause_mid_episode_splits_the_running_turn():
    episode, _ = await _pause_in_second_turn(FakeEngine(token_delay_s=0.005), PauseMode.KEEP)
    assert _turn_versions(episode.trajectory) == [[0], [0, 1], [1]]


async def test_abort_pause_mid_episode_samples_the_cut_turn_again():
    episode, r = await _pause_in_second_turn(FakeEngine(token_delay_s=0.005), PauseMode.ABORT)
    t = episode.trajectory
    assert _turn_versions(t) == [[0], [1], [1]] and r.counters.resubmitted == 1
    assert [b - a for a, b in turn_slices(t)] == [6, 6, 6], "the cut turn's partial tokens are thrown away"


async def test_abort_pause_with_drop_policy_drops_the_group():
    with pytest.raises(RolloutDropped) as info:
        await _pause_in_second_turn(FakeEngine(token_delay_s=0.005), PauseMode.ABORT, on_abort=AbortPolicy.DROP)
    assert info.value.reason is DropReason.ABORTED


async def test_wait_pause_mid_episode_lets_the_turn_finish_under_the_old_weights():
    episode, _ = await _pause_in_second_turn(FakeEngine(token_delay_s=0.005), PauseMode.WAIT)
    assert _turn_versions(episode.trajectory) == [[0], [0], [1]]
    assert episode.trajectory.oldest_version == 0, "staleness is the oldest model token's"


# ------------------------------------------------------------------------------------------------ rewards + pipeline


async def test_rewards_are_the_environments_plus_a_trajectory_reward():
    sent = []

    class Sink:
        async def send(self, group):
            sent.append(group)
            return True

    cfg = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=2))
    reward = lambda prompt, trajectory: float(len(model_token_ids(trajectory)))  # noqa: E731
    producer = Producer(FakeEngine(), PromptSource([PROMPT]), reward, Sink(), cfg, env=lambda p: ScriptedEnv())
    await producer.run()
    assert sent[0].rewards == (1.5 + 6.0, 1.5 + 6.0)
    with pytest.raises(ValueError):
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
    pipe = grpo_pipeline(FakeEngine(vocab_size=TinyLM.VOCAB), model, [PROMPT] * 8, None, config,
                         loss=MaskLoss(LossConfig()), env=lambda p: ScriptedEnv(turns=2))
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
