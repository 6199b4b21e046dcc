"""The agent layer without vLLM: tool-call parsing, the continuation rule, sessions, stop strings, request
validation, and the runner's groups and drops (on ``FakeEngine`` behind a real endpoint)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from asyncrl.agents import AgentConfig, AgentRunner, ChatRenderer, HermesToolParser, ParsedTurn, Session, ToolCall
from asyncrl.agents import wire
from asyncrl.agents.sessions import normalise
from asyncrl.agents.stops import cut_at_stop
from asyncrl.engines.fake import FakeEngine
from asyncrl.errors import RolloutDropped
from asyncrl.types import DropReason, FinishReason, Prompt, Sample, VersionSpan
from tests.support.agents import TEMPLATE, TOKEN, Echo, client, echo_agent, endpoint_on, renderer

USER = {"role": "user", "content": "12+3="}


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def _call(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"text": text})}}]}


def _sample(ids: tuple[int, ...], finish: FinishReason = FinishReason.LENGTH) -> Sample:
    return Sample(ids, (-0.5,) * len(ids), finish, (VersionSpan(0, 0, len(ids)),))


# -- tool calls ---------------------------------------------------------------------------------------------


def test_hermes_parser_takes_valid_calls_and_keeps_the_rest_as_text() -> None:
    p = HermesToolParser()
    turn = p.parse('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> done')
    assert turn.tool_calls == (ToolCall("add", '{"a": 1}'),)
    assert turn.content == "Let me add.  done"
    assert p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>').tool_calls == (
        ToolCall("f", '{"x": 2}'),)  # string arguments are kept as sent
    bad = 'x <tool_call>{"name": "add", "arguments": {</tool_call> y'
    assert p.parse(bad) == ParsedTurn(bad)  # invalid JSON: the text stays, no call
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert p.parse(no_name) == ParsedTurn(no_name)
    assert p.parse("plain") == ParsedTurn("plain")


def test_normalise_ignores_tool_call_ids_and_argument_spelling() -> None:
    a, b = _call("15"), _call("15")
    b["tool_calls"][0]["id"] = "another"
    b["tool_calls"][0]["function"]["arguments"] = '{"text":"15"}'  # other JSON spacing
    assert normalise(a) == normalise(b)
    assert normalise(a) != normalise(_call("16"))
    parts = {"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "3="}]}
    assert normalise(parts) == normalise(USER)


# -- the continuation rule ----------------------------------------------------------------------------------


def test_continuation_appends_the_closing_a_length_cut_turn_lacks(tokenizer) -> None:
    r = renderer(tokenizer)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "7"}
    cont = r.continuation([USER], _call("15"), _ids(tokenizer, "15"), [tool], None)
    assert cont == _ids(tokenizer, "</s><s>7=")  # the template's end of turn, out of the loss, then the tool
    closed = r.continuation([USER], _call("15"), _ids(tokenizer, "15</s>"), [tool], None)
    assert closed == _ids(tokenizer, "<s>7=")  # the sampled ids close the turn already: nothing added
    assert r.counters.template_mismatches == 0
    other = r.continuation([USER], _call("15"), _ids(tokenizer, "16"), [tool], None)
    assert other == _ids(tokenizer, "<s>7=") and r.counters.template_mismatches == 1  # kept as sampled


def test_a_template_rewriting_earlier_turns_cannot_be_continued_and_splits(tokenizer) -> None:
    counting = "{{ messages | length }}" + TEMPLATE  # every rendering starts with its message count
    r = ChatRenderer(tokenizer, counting, Echo())
    more = [{"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    assert r.continuation([USER], _call("15"), _ids(tokenizer, "15"), more, None) is None
    s = Session("k")
    prompt, parent, added = s.prompt_for(r, [USER], None)
    s.record([USER], prompt, parent, added, [_sample(_ids(tokenizer, "15"))], [r.parse("15")])
    history = [USER, _call("15"), *more]
    prompt, parent, added = s.prompt_for(r, history, None)
    assert parent is None and prompt == r.prompt_ids(history, None)
    s.record(history, prompt, parent, added, [_sample(_ids(tokenizer, "3"))], [r.parse("3")])
    assert s.counters.splits == 1 and len(s.trajectories()) == 2


def test_session_extends_a_branch_token_exactly(tokenizer) -> None:
    r, s = renderer(tokenizer), Session("k")
    first = _ids(tokenizer, "15")
    prompt, parent, added = s.prompt_for(r, [USER], None)
    s.record([USER], prompt, parent, added, [_sample(first)], [r.parse("15")])
    history = [USER, _call("15"), {"role": "tool", "tool_call_id": "other-id", "content": "7"}]
    prompt2, parent, added = s.prompt_for(r, history, None)
    assert parent is not None and prompt2 == prompt + first + _ids(tokenizer, "</s><s>7=")
    second = _ids(tokenizer, "22")
    s.record(history, prompt2, parent, added, [_sample(second, FinishReason.STOP)], [r.parse("22")])
    [(head, traj)] = s.trajectories()
    assert head == prompt and traj.token_ids == first + added + second
    assert traj.loss_mask == (1,) * len(first) + (0,) * len(added) + (1,) * len(second)
    assert (s.counters.extensions, s.counters.splits) == (1, 0)


# -- stop strings ---------------------------------------------------------------------------------------------


def test_cut_at_stop_keeps_the_stop_ids_and_drops_the_stop_text(tokenizer) -> None:
    r = renderer(tokenizer)
    ids = _ids(tokenizer, "12+3=15+4")
    cut = cut_at_stop(_sample(ids), ["=", "+4"], r)
    assert cut is not None
    sample, text = cut
    assert text == "12+3" and sample.finish_reason is FinishReason.STOP
    assert r.decode(sample.token_ids) == "12+3="  # ids up to the token completing the stop string
    assert len(sample.logprobs) == len(sample.token_ids) and sample.version_spans[-1].end == len(sample.token_ids)
    assert cut_at_stop(_sample(ids), ["99"], r) is None


# -- request validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({}, "model"),
    ({"model": "m", "n": 0}, "n"),
    ({"model": "m", "n": 17}, "n"),
    ({"model": "m", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "temperature": 3}, "temperature"),
    ({"model": "m", "top_p": 0}, "top_p"),
    ({"model": "m", "seed": "7"}, "seed"),
    ({"model": "m", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "logprobs": 2}, "logprobs"),
    ({"model": "m", "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "stream": "yes"}, "stream"),
])
def test_common_fields_name_the_bad_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(wire.OpenAIError) as err:
        wire.common_fields(body, max_n=16)
    assert (err.value.status, err.value.param) == (400, param)


def test_messages_field_names_the_bad_message() -> None:
    for messages, param in (([], "messages"), ("hi", "messages"), ([USER, {"role": "robot"}], "messages[1]"),
                            ([USER, {"role": "tool", "content": "7"}], "messages[1].tool_call_id")):
        with pytest.raises(wire.OpenAIError) as err:
            wire.messages_field({"messages": messages})
        assert err.value.param == param
    assert wire.messages_field({"messages": [USER]}) == [USER]


# -- the runner ------------------------------------------------------------------------------------------------


async def _group(tokenizer, agent, reward_fn=None, timeout_s: float = 30.0, n: int = 2):
    engine = FakeEngine(vocab_size=len(tokenizer))
    async with endpoint_on(engine, tokenizer) as ep:
        runner = AgentRunner(ep, agent, reward_fn, AgentConfig(timeout_s=timeout_s))
        prompt = Prompt("p0", (), "12+3=")
        return await runner.build_group("g0", prompt, n=n), runner


def _reward_raises(prompt: Prompt, result: Any) -> float:
    raise RuntimeError("judge down")


async def _post_reward(url: str, reward: Any) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(url.removesuffix("/v1") + "/reward", json={"reward": reward},
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text


async def test_runner_groups_every_trajectory_behind_the_common_prompt(tokenizer) -> None:
    async def agent(url: str, key: str, task: str) -> int:
        await echo_agent(url, task, turns=2)
        await echo_agent(url, "1+" + task, turns=1)  # the agent starts over on another history: a split
        return 1

    group, runner = await _group(tokenizer, agent, reward_fn=lambda prompt, result: float(result))
    assert len(group.rollouts) == 4  # 2 episodes, each split into 2 trajectories
    assert group.meta == {"episodes": 2, "splits": 2}
    assert group.prompt.token_ids == _ids(tokenizer, "<s>1")  # "<s>12+3=" and "<s>1+12+3=" share "<s>1"
    rests = []
    for rollout in group.rollouts:
        traj = rollout.sample
        assert rollout.reward == 1.0 and len(traj.loss_mask) == len(traj.token_ids) == len(traj.logprobs)
        head = traj.loss_mask.index(1)
        rests.append(traj.token_ids[:head])  # the rest of its first prompt, out of the loss
        assert traj.logprobs[:head] == (0.0,) * head and traj.version_spans[0].start == head
    assert sorted(rests) == sorted([_ids(tokenizer, "+12+3="), _ids(tokenizer, "2+3=")] * 2)
    assert runner.counters.splits == 2 and runner.counters.trajectories == 4


async def test_runner_drops_with_the_reason(tokenizer) -> None:
    async def raises(url: str, key: str, task: str) -> None:
        await echo_agent(url, task, turns=1)
        raise ValueError("agent bug")

    async def idle(url: str, key: str, task: str) -> None:
        return None

    never = asyncio.Event()

    async def hangs(url: str, key: str, task: str) -> None:
        await never.wait()

    async def posts(reward: Any):
        async def agent(url: str, key: str, task: str) -> None:
            await echo_agent(url, task, turns=1)
            if reward is not None:
                await _post_reward(url, reward)
        return agent

    cases = [(raises, {}, DropReason.AGENT_ERROR), (idle, {"reward_fn": lambda p, r: 1.0}, DropReason.AGENT_IDLE),
             (hangs, {"timeout_s": 0.2}, DropReason.AGENT_TIMEOUT), (await posts(None), {}, DropReason.REWARD_INVALID),
             (await posts(1.0), {"reward_fn": lambda p, r: float("nan")}, DropReason.REWARD_INVALID),
             (await posts(1.0), {"reward_fn": _reward_raises}, DropReason.REWARD_ERROR)]
    for agent, kw, reason in cases:
        with pytest.raises(RolloutDropped) as err:
            await _group(tokenizer, agent, **kw)
        assert err.value.reason is reason, (agent, err.value)


async def test_runner_takes_posted_rewards(tokenizer) -> None:
    async def agent(url: str, key: str, task: str) -> None:
        await echo_agent(url, task, turns=1)
        await _post_reward(url, 0.5)

    group, _ = await _group(tokenizer, agent)
    assert [r.reward for r in group.rollouts] == [0.5, 0.5]


class _Gated(FakeEngine):
    """A fake engine that says when a request reaches it and when one is cancelled there."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.entered, self.cancelled = asyncio.Event(), asyncio.Event()

    async def generate(self, *args: Any, **kw: Any) -> list[Sample]:
        self.entered.set()
        try:
            return await super().generate(*args, **kw)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_client_that_hangs_up_cancels_its_call_and_nothing_is_recorded(tokenizer) -> None:
    from asyncrl.types import PauseMode

    engine = _Gated(vocab_size=len(tokenizer))
    await engine.pause(PauseMode.KEEP, clear_cache=False)  # the call waits in the engine until cancelled
    async with endpoint_on(engine, tokenizer) as ep:
        url = ep.open_session("s")
        call = asyncio.create_task(echo_agent(url, "12+3=", turns=1))
        await asyncio.wait_for(engine.entered.wait(), 30)
        call.cancel()  # the agent gives up: its HTTP connection closes
        await asyncio.wait_for(engine.cancelled.wait(), 30)
        await engine.resume()
        session = ep.close_session("s")
    assert session.calls == [] and session.trajectories() == []
    assert ep.counters.calls == 0


class _Recording(FakeEngine):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.params: list[Any] = []

    async def generate(self, prompt_ids: Any, params: Any, *args: Any, **kw: Any) -> list[Sample]:
        self.params.append(params)
        return await super().generate(prompt_ids, params, *args, **kw)


@pytest.mark.parametrize(("policy", "sent", "want"), [
    (None, {}, (1.0, 1.0)),  # OpenAI's defaults
    (None, {"temperature": 0.0, "top_p": 0.5}, (1e-6, 0.5)),  # 0 is greedy
    (None, {"temperature": 0.7, "top_p": 0.9}, (0.7, 0.9)),
    (0.8, {"temperature": 0.0, "top_p": 0.5}, (0.8, 1.0)),  # training: the policy's, whatever is asked
])
async def test_requests_sample_as_asked_unless_the_policy_temperature_is_set(tokenizer, policy, sent, want) -> None:
    engine = _Recording(vocab_size=len(tokenizer))
    async with endpoint_on(engine, tokenizer, temperature=policy) as ep:
        oai = client(ep.base_url)
        await oai.chat.completions.create(model="m", messages=[USER], max_tokens=2, **sent)
        await oai.close()
    [params] = engine.params
    assert (params.temperature, params.top_p) == want


async def test_each_choice_is_a_branch_and_one_not_continued_is_a_trajectory(tokenizer) -> None:
    engine = FakeEngine(vocab_size=len(tokenizer))
    async with endpoint_on(engine, tokenizer) as ep:
        oai = client(ep.open_session("s"))
        first = await oai.chat.completions.create(model="m", messages=[USER], max_tokens=3, n=2)
        kept = first.choices[1].message  # the agent goes on with the second choice
        history = [USER, kept.model_dump(exclude_none=True), {"role": "user", "content": "1+1="}]
        await oai.chat.completions.create(model="m", messages=history, max_tokens=3)
        await oai.close()
        session = ep.close_session("s")
    assert (session.counters.calls, session.counters.extensions, session.counters.splits) == (2, 1, 0)
    trajectories = session.trajectories()
    assert len(trajectories) == 2  # the first choice, alone; the second, continued
    (head_a, a), (head_b, b) = trajectories
    assert head_a == head_b == _ids(tokenizer, "<s>12+3=")
    assert a.token_ids == tuple(first.choices[0].model_extra["asyncrl"]["token_ids"]) and set(a.loss_mask) == {1}
    assert b.token_ids[:3] == tuple(first.choices[1].model_extra["asyncrl"]["token_ids"])
    assert 0 in b.loss_mask and b.loss_mask[-1] == 1


async def test_streamed_and_whole_answers_of_one_sample_are_the_same(tokenizer) -> None:
    """The fake engine samples the same ids for the same prompt: the two wire formats can be compared directly."""
    engine = FakeEngine(vocab_size=len(tokenizer))
    args = dict(model="m", messages=[USER], tools=[], max_tokens=5, logprobs=True)
    async with endpoint_on(engine, tokenizer) as ep:
        oai = client(ep.base_url)
        whole = (await oai.chat.completions.create(**args)).choices[0]
        content, calls, lps, finish = "", [], [], None
        async for chunk in await oai.chat.completions.create(**args, stream=True):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                calls += chunk.choices[0].delta.tool_calls or []
                lps += [e.logprob for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
                finish = chunk.choices[0].finish_reason or finish
        await oai.close()
    assert content == (whole.message.content or "") and finish == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert lps == [e.logprob for e in whole.logprobs.content] and len(lps) == 5
