"""Multi-turn episodes on the real in-process vLLM engine (tiny model): the ids trained are the ids sampled,
pauses in every mode in the middle of an episode, failing environments as counted drops, and log-prob parity
of a whole trajectory after a sync."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from asyncrl import (
    DropReason, EpisodeConfig, ProducerConfig, Prompt, SamplingConfig, SyncConfig, VersionClock, WeightSync,
)
from asyncrl.episodes import StepResult, ToolBox, ToolCall, ToolEnv
from asyncrl.actors.producer import Producer
from asyncrl.algorithms import GRPOLoss, LossConfig, completion_logprobs
from asyncrl.data import PromptSource
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.episodes import EpisodeGroups, EpisodeRunner, model_token_ids, turn_slices
from asyncrl.queues.wire import group_from_json, group_to_json
from asyncrl.types import FinishReason, PauseMode, Rollout, RolloutGroup, Sample
from tests.support import load_hf_model, perturb

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PARITY_ATOL = 2e-3  # float32 engine vs float32 transformers, as in tests/support/vllm_engine.py
PAUSE_ATTEMPTS = 3  # a round whose pause missed the second turn (it had not started yet) proves nothing


class Spy:
    """A ``Sampler`` in front of the engine recording every turn: the request id, the context the engine got,
    and the sample it returned. ``on_call(request_id)`` runs as each call is made."""

    def __init__(self, engine, on_call: Callable[[str], None] = lambda rid: None) -> None:
        self.engine, self.on_call, self.name = engine, on_call, engine.name
        self.calls: list[tuple[str, tuple[int, ...], Sample]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def generate(self, prompt_ids, params, request_id, n=None):
        self.on_call(request_id)
        samples = await self.engine.generate(prompt_ids, params, request_id, n)
        self.calls.extend((request_id, prompt_ids, s) for s in samples)
        return samples


class FixedEnv:
    """Appends ``ids`` after every turn; done after ``turns`` steps. ``fail`` runs before the step ``fail_at``."""

    def __init__(self, ids: tuple[int, ...], turns: int, fail_at: int | None = None, fail=None) -> None:
        self.ids, self.turns, self.fail_at, self.fail = ids, turns, fail_at, fail
        self.steps = 0
        self.closed = False

    async def step(self, turn: Sample) -> StepResult:
        self.steps += 1
        if self.steps == self.fail_at:
            return await self.fail()
        return StepResult(self.ids, reward=float(self.steps), done=self.steps == self.turns, text="<env>")

    async def close(self) -> None:
        self.closed = True


def _prompt(tokenizer, text: str = "12+34=") -> Prompt:
    return Prompt(f"p-{text}", tuple(tokenizer(text).input_ids), text)


def _non_canonical_ids(tokenizer) -> tuple[int, ...]:
    """Ids that are not what the tokenizer makes of their own text: decoding them and encoding the text again
    gives other ids (the drift a re-tokenising rollout would train on). Tried both ways round: characters where
    the tokenizer merges them, and a merged token where it splits."""
    for text in ("=12", "+12", "12", "=1", "10"):
        canonical = tuple(tokenizer(text, add_special_tokens=False).input_ids)
        for ids in (tuple(tokenizer.convert_tokens_to_ids(list(text))), (tokenizer.convert_tokens_to_ids(text),)):
            if tokenizer.unk_token_id not in ids and ids != canonical and tokenizer.decode(ids) == text:
                return ids
    raise AssertionError("every candidate re-encodes to the same ids")


def _config(n: int, max_tokens: int, **episode) -> ProducerConfig:
    return ProducerConfig(sampling=SamplingConfig(n=n, max_tokens=max_tokens, ignore_eos=True, seed=3),
                          episode=EpisodeConfig(**episode))


class RecordingModel(torch.nn.Module):
    """The learner's model, recording the input ids of every forward pass."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.inputs: list[torch.Tensor] = []

    def forward(self, **kwargs):
        self.inputs.append(kwargs["input_ids"].clone())
        return self.inner(**kwargs)


async def test_sampled_ids_are_the_trained_ids_across_four_turns(vllm_engine, tokenizer, tiny_model_dir):
    env_ids = _non_canonical_ids(tokenizer)
    spy = Spy(vllm_engine)
    prompt = _prompt(tokenizer)
    runner = EpisodeRunner(spy, lambda p: FixedEnv(env_ids, turns=4), _config(2, 8, max_turns=6))
    episodes = await runner.run_group("ids", prompt)
    for i, episode in enumerate(episodes):
        t = episode.trajectory
        turns = [(rid, ctx, s) for rid, ctx, s in spy.calls if rid.startswith(f"ids/e{i}/")]
        assert episode.turns == len(turns) == 4 and t.finish_reason is FinishReason.STOP
        assert t.loss_mask == ((1,) * 8 + (0,) * len(env_ids)) * 4
        # What the engine sampled, turn by turn, is what the trajectory holds, log-probs included...
        assert model_token_ids(t) == sum((s.token_ids for _, _, s in turns), ())
        assert [lp for lp, m in zip(t.logprobs, t.loss_mask) if m] == [lp for *_, s in turns for lp in s.logprobs]
        # ... each turn was sampled from the prompt and exactly the ids before it ...
        assert [ctx for _, ctx, _ in turns] == [prompt.token_ids + t.token_ids[:a] for a, _ in turn_slices(t)]
        # ... and the environment's ids are kept as it wrote them, though text would re-encode differently.
        assert all(t.token_ids[b:b + len(env_ids)] == env_ids for _, b in turn_slices(t))
        assert tuple(tokenizer(tokenizer.decode(t.token_ids), add_special_tokens=False).input_ids) != t.token_ids
    group = RolloutGroup("ids", prompt, tuple(Rollout(e.trajectory, e.env_reward) for e in episodes))
    group = group_from_json(group_to_json(group))  # through the wire too, as a remote producer would send it
    model = RecordingModel(load_hf_model(tiny_model_dir))
    out = GRPOLoss(LossConfig()).compute(model, [group])
    [inputs] = model.inputs
    for row, rollout in zip(inputs.tolist(), group.rollouts):
        trained = prompt.token_ids + rollout.sample.token_ids
        assert tuple(row[: len(trained)]) == trained, "the learner scores exactly the sampled context"
    assert out.num_tokens == 2 * 4 * 8 == group.num_tokens


async def test_logprob_parity_on_a_multi_turn_trajectory_after_sync(vllm_engine, tokenizer, tiny_model_dir):
    learner = perturb(load_hf_model(tiny_model_dir), seed=5)  # the learner has trained: not the engine's weights
    timing = await WeightSync(vllm_engine, VersionClock(vllm_engine.version), SyncConfig()).publish(
        state_dict_for_engine(learner))
    prompt = _prompt(tokenizer, "7+8=")
    env_ids = _non_canonical_ids(tokenizer)
    runner = EpisodeRunner(vllm_engine, lambda p: FixedEnv(env_ids, turns=3), _config(4, 10))
    episodes = await runner.run_group("parity", prompt)
    trajectories = [e.trajectory for e in episodes]
    assert all(s.version == timing.version for t in trajectories for s in t.version_spans)
    with torch.no_grad():
        scored = completion_logprobs(learner, [prompt.token_ids] * 4, [t.token_ids for t in trajectories],
                                     loss_masks=[t.loss_mask for t in trajectories])
    behaviour = torch.tensor([t.logprobs for t in trajectories])
    mask = torch.tensor([t.loss_mask for t in trajectories], dtype=torch.float32)
    assert torch.equal(scored.mask, mask)
    diff = float(((scored.logprobs - behaviour) * mask).abs().max())
    assert diff < PARITY_ATOL, f"learner vs engine log-probs of the model tokens differ by {diff}"
    assert int(mask.sum()) == 4 * 3 * 10


async def _first_token_seen(engine) -> None:
    """Returns once a probe submitted now has a token: requests submitted before it are generating too."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA)
    async for _ in engine.llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, request_id=f"probe-{id(sp)}"):
        return


async def _pause_in_second_turn(engine, tokenizer, model, mode: PauseMode, tag: str):
    """An episode of three 70-token turns; publish ``model`` with ``mode`` while the second turn runs."""
    second = asyncio.Event()
    spy = Spy(engine, on_call=lambda rid: second.set() if rid.endswith("/t1") else None)
    runner = EpisodeRunner(spy, lambda p: FixedEnv((17,), turns=3), _config(1, 70, max_episode_tokens=240))
    before = engine.version
    task = asyncio.create_task(runner.run(_prompt(tokenizer), tag))
    await second.wait()
    await _first_token_seen(engine)
    await WeightSync(engine, VersionClock(before), SyncConfig(mode=mode)).publish(state_dict_for_engine(model))
    return await asyncio.wait_for(task, 60), spy, runner, before


def _turn_versions(t: Sample) -> list[list[int]]:
    return [[s.version for s in t.version_spans if a <= s.start < b] for a, b in turn_slices(t)]


@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.ABORT, PauseMode.WAIT])
async def test_pause_in_the_middle_of_an_episode(vllm_engine, tokenizer, tiny_model_dir, mode):
    model = load_hf_model(tiny_model_dir)
    for attempt in range(PAUSE_ATTEMPTS):
        episode, spy, runner, v = await _pause_in_second_turn(vllm_engine, tokenizer, model, mode,
                                                               f"pause-{mode.value}-{attempt}")
        versions = _turn_versions(episode.trajectory)
        cut = [s for rid, _, s in spy.calls if s.finish_reason is FinishReason.ABORT]
        landed = {PauseMode.KEEP: versions[1] == [v, v + 1], PauseMode.ABORT: bool(cut),
                  PauseMode.WAIT: versions[1] == [v]}[mode]
        if landed or attempt == PAUSE_ATTEMPTS - 1:
            break
    t = episode.trajectory
    assert [b - a for a, b in turn_slices(t)] == [70, 70, 70] and t.finish_reason is FinishReason.STOP
    if mode is PauseMode.KEEP:  # the running turn froze and went on under the new weights
        assert versions == [[v], [v, v + 1], [v + 1]], t.version_spans
    elif mode is PauseMode.ABORT:  # the cut turn was sampled again, all of it under the new weights
        assert versions == [[v], [v + 1], [v + 1]], t.version_spans
        assert runner.counters.resubmitted == 1
        assert len(cut) == 1 and 0 < len(cut[0].token_ids) < 70
        assert spy.calls[2][0].endswith("/t1/r1") and spy.calls[2][2].token_ids == t.token_ids[71:141]
    else:  # the running turn finished under the old weights; the next one waited for the new
        assert versions == [[v], [v], [v + 1]], t.version_spans
    assert t.oldest_version == v and t.newest_version == v + 1


async def _hang() -> StepResult:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _raise() -> StepResult:
    raise RuntimeError("the sandbox crashed")


async def _flood() -> StepResult:
    return StepResult(tuple(range(10, 60)))


async def _tool_hangs() -> StepResult:
    async def calculator(expression: str) -> str:
        await asyncio.Event().wait()
        return expression

    env = ToolEnv(ToolBox([calculator], timeout_s=0.3), parse=lambda turn: ToolCall("calculator", ("1+1",)),
                  render=lambda result: ((17,), result.output))
    return await env.step(Sample((), (), FinishReason.STOP, ()))  # type: ignore[arg-type]


@pytest.mark.parametrize("fail, reason", [
    (_raise, DropReason.ENV_ERROR), (_hang, DropReason.ENV_TIMEOUT), (_flood, DropReason.ENV_OUTPUT_TOO_LONG),
    (_tool_hangs, DropReason.TOOL_TIMEOUT),
])
async def test_failing_environment_is_a_counted_drop_without_a_hang(vllm_engine, tokenizer, fail, reason):
    envs: list[FixedEnv] = []

    def factory(prompt):  # episode 0 fails at its second step; episode 1 is mid-turn then, and is cancelled
        envs.append(FixedEnv((17,), turns=3, fail_at=2 if not envs else None, fail=fail))
        return envs[-1]

    class Sink:
        async def send(self, group, *, ticket=None):
            raise AssertionError("a failed group must not be sent")

    cfg = _config(2, 40, env_timeout_s=1.0, max_env_tokens=16)
    producer = Producer(vllm_engine, PromptSource([]), EpisodeGroups(factory), Sink(), cfg)
    async with asyncio.timeout(30):
        assert await producer.produce_one(0, _prompt(tokenizer)) is None
    assert producer.counters.dropped == {reason: 1}
    assert all(e.closed for e in envs) and len(envs) == 2
    assert vllm_engine.llm.output_processor.get_num_unfinished_requests() == 0, "cancelled turns were aborted"


async def test_stop_token_ids_end_a_turn_on_the_engine(vllm_engine, tokenizer):
    params = SamplingConfig(n=4, max_tokens=8, stop_token_ids=tuple(range(128)))  # every id stops
    samples = await vllm_engine.generate(_prompt(tokenizer).token_ids, params, request_id="stop-ids")
    for s in samples:
        assert s.finish_reason is FinishReason.STOP and len(s.token_ids) == 1, "the stop token is kept"
