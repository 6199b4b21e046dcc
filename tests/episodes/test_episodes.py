"""Multi-turn episodes on the in-memory FakeEngine: trajectories, limits, drops, tools and pauses (rewards,
training, the masked loss and the wire format are in test_episodes_training.py; the real engine is in
test_episodes_vllm.py)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from asyncrl import AbortPolicy, DropReason, EpisodeConfig, ProducerConfig, Prompt, RolloutDropped, SamplingConfig
from asyncrl.episodes import StepResult, ToolBox, ToolCall, ToolEnv
from asyncrl.actors.producer import Producer
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.episodes import EpisodeGroups, EpisodeRunner, TrajectoryBuilder, model_token_ids, turn_slices
from asyncrl.types import FinishReason, PauseMode, Sample, VersionSpan
from tests.support.episodes import ENV_IDS, PROMPT, ScriptedEnv


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
    sent = []

    class Sink:
        async def send(self, group, *, ticket=None):
            sent.append(group)
            return True

    prompts = PromptSource([PROMPT, replace(PROMPT, prompt_id="p1")])
    calls = iter([FloodingEnv(), FloodingEnv(), ScriptedEnv(), ScriptedEnv()])
    cfg = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=2), episode=EpisodeConfig(max_env_tokens=8))
    producer = Producer(FakeEngine(), prompts, EpisodeGroups(lambda p: next(calls)), Sink(), cfg)
    await producer.run()
    assert producer.counters.dropped == {DropReason.ENV_OUTPUT_TOO_LONG: 1} and len(sent) == 1
    assert producer.groups.metrics()["episode/episodes"] == 2


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
