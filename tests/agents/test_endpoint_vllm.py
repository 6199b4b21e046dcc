"""The agent endpoint in front of the session's real vLLM engine, driven by the real ``openai`` client: trained ids
are the ids the client received, history rewrites split, streaming agrees with non-streaming, completions extend
by text, pauses in every mode, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from asyncrl.engines.updates import InMemory
from asyncrl.engines.protocols import WeightUpdate
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.types import PauseMode
from tests.support import apply_update, load_hf_model
from tests.support.agents import TOKEN, TOOLS, EndlessSampler, client, echo_agent, endpoint_on, renderer

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
MODEL = "asyncrl-policy"


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


async def test_trained_ids_are_the_ids_the_client_received(vllm_engine, tokenizer) -> None:
    async with endpoint_on(vllm_engine, tokenizer) as ep:
        responses = await echo_agent(ep.open_session("s"), "12+3=", turns=4)
        s = ep.close_session("s")
    assert (s.counters.calls, s.counters.extensions, s.counters.splits) == (4, 3, 0)
    [(first, traj)] = s.trajectories()
    assert first == s.calls[0].prompt_ids == _ids(tokenizer, "<s>12+3=")
    received = [tuple(r.choices[0].model_extra["asyncrl"]["token_ids"]) for r in responses]
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for k, (r, got) in enumerate(zip(responses, received, strict=True)):
        prompt = s.calls[k].prompt_ids
        assert s.calls[k].samples[0].token_ids == got
        if k:  # the previous context, its sampled ids as sampled, then the continuation
            before = s.calls[k - 1].prompt_ids + received[k - 1]
            assert prompt[:len(before)] == before
            cont = prompt[len(before):]
            new = "<s>7=" if responses[k - 1].choices[0].message.tool_calls else "<s>1+1="
            assert cont in (_ids(tokenizer, new), _ids(tokenizer, "</s>" + new))  # the template's closing, or none
            ids += cont
            mask += [0] * len(cont)
            lps += [0.0] * len(cont)
        ids += got
        mask += [1] * len(got)
        lps += [e.logprob for e in r.choices[0].logprobs.content]
    assert traj.token_ids == tuple(ids)
    assert traj.loss_mask == tuple(mask)
    assert traj.logprobs == pytest.approx(lps, abs=1e-6)


async def test_a_history_rewrite_splits(vllm_engine, tokenizer) -> None:
    async with endpoint_on(vllm_engine, tokenizer) as ep:
        oai = client(ep.open_session("s"))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
        for _ in range(2):
            r = await oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, seed=1)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "2+2="}]
        edited = [{"role": "user", "content": "9+9="}, *messages[1:]]  # the agent rewrites its first message
        await oai.chat.completions.create(model=MODEL, messages=edited, tools=TOOLS, max_tokens=4, seed=1)
        await oai.close()
        s = ep.close_session("s")
    assert (s.counters.calls, s.counters.extensions, s.counters.splits) == (3, 1, 1)
    heads = [first for first, _ in s.trajectories()]
    assert heads == [_ids(tokenizer, "<s>12+3="), renderer(tokenizer).prompt_ids(edited, TOOLS)]
    assert not s.calls[2].extended


async def test_streaming_agrees_with_non_streaming(vllm_engine, tokenizer) -> None:
    """Each answer, streamed or not, reports exactly the sample its session recorded (two requests cannot be
    compared with each other: a random tiny model's near-ties let even greedy decoding differ between batches)."""
    messages = [{"role": "user", "content": "1+2="}]
    args = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, logprobs=True)
    async with endpoint_on(vllm_engine, tokenizer) as ep:
        oai = client(ep.open_session("whole"))
        whole = (await oai.chat.completions.create(**args)).choices[0]
        await oai.close()
        oai = client(ep.open_session("stream"))
        stream = await oai.chat.completions.create(**args, stream=True)
        content, calls, lps, finish, extra = "", [], [], None, None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            lps += [e.logprob for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
            finish = chunk.choices[0].finish_reason or finish
            extra = chunk.choices[0].model_extra.get("asyncrl") or extra
        await oai.close()
        recorded = {k: ep.close_session(k).calls[0].samples[0] for k in ("whole", "stream")}
    answers = {"whole": (whole.message.content or "", [(c.function.name, c.function.arguments)
                                                       for c in whole.message.tool_calls or []],
                         [e.logprob for e in whole.logprobs.content], whole.finish_reason,
                         whole.model_extra["asyncrl"]),
               "stream": (content, [(c.function.name, c.function.arguments) for c in calls], lps, finish, extra)}
    r = renderer(tokenizer)
    for kind, (text, tool_calls, logprobs, reason, ext) in answers.items():
        sample = recorded[kind]
        turn = r.parse(r.decode(sample.token_ids))
        assert text == turn.content and tool_calls == [(c.name, c.arguments) for c in turn.tool_calls], kind
        assert logprobs == list(sample.logprobs) and ext["token_ids"] == list(sample.token_ids), kind
        assert reason == ("tool_calls" if turn.tool_calls else sample.finish_reason.value), kind
    assert ep.counters.streamed == 1


async def test_completions_extend_by_text_prefix(vllm_engine, tokenizer) -> None:
    async with endpoint_on(vllm_engine, tokenizer) as ep:
        oai = client(ep.open_session("c"))
        first = await oai.completions.create(model=MODEL, prompt="12+3=", max_tokens=4, seed=2)
        text = "12+3=" + first.choices[0].text + "1+1="
        await oai.completions.create(model=MODEL, prompt=text, max_tokens=4, seed=3)
        await oai.close()
        s = ep.close_session("c")
    sampled = tuple(first.choices[0].model_extra["asyncrl"]["token_ids"])
    assert (s.counters.extensions, s.counters.splits) == (1, 0)
    assert s.calls[1].prompt_ids == _ids(tokenizer, "12+3=") + sampled + _ids(tokenizer, "1+1=")
    [(head, traj)] = s.trajectories()
    assert head == _ids(tokenizer, "12+3=") and traj.token_ids[:len(sampled)] == sampled


async def _flowing(engine: Any, prefix: str) -> None:
    """Returns once a request whose id starts with ``prefix`` has its first tokens out of the engine. The engine
    has no event for another request's progress: its request states are checked every 10 ms."""
    async with asyncio.timeout(60):
        while not any(r.external_req_id.startswith(prefix) and not r.is_prefilling
                      for r in engine.llm.output_processor.request_states.values()):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.ABORT, PauseMode.WAIT])
async def test_a_publication_mid_call_in_each_pause_mode(vllm_engine, tiny_model_dir, tokenizer, mode) -> None:
    endless = EndlessSampler(vllm_engine)
    base = state_dict_for_engine(load_hf_model(tiny_model_dir))  # the weights every test starts from
    async with endpoint_on(endless, tokenizer) as ep:
        oai = client(ep.open_session("p"))
        call = asyncio.create_task(oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "12+3="}], max_tokens=200))
        await _flowing(vllm_engine, "agent-p-")
        old = vllm_engine.version
        await vllm_engine.pause(mode, clear_cache=True)
        try:
            await apply_update(vllm_engine, WeightUpdate(old + 1, InMemory(base)))
            assert not call.done() or mode is PauseMode.WAIT
        finally:
            await vllm_engine.resume()
        choice = (await asyncio.wait_for(call, 120)).choices[0]
        await oai.close()
    spans = [tuple(v) for v in choice.model_extra["asyncrl"]["version_spans"]]
    assert len(choice.model_extra["asyncrl"]["token_ids"]) == 200 and choice.finish_reason in ("length",
                                                                                                "tool_calls")
    if mode is PauseMode.KEEP:
        assert [v for v, _, _ in spans] == [old, old + 1] and 0 < spans[0][2] == spans[1][1] < 200, spans
    elif mode is PauseMode.WAIT:
        assert spans == [(old, 0, 200)]
    else:
        assert ep.counters.resubmitted >= 1 and spans == [(old + 1, 0, 200)]
    assert ep.counters.resubmitted == (mode is PauseMode.ABORT)


async def test_bad_requests_get_openai_errors(vllm_engine, tokenizer) -> None:
    msgs = [{"role": "user", "content": "1+2="}]
    async with endpoint_on(vllm_engine, tokenizer, max_n=2, max_body_bytes=4096) as ep:
        async with client(ep.base_url, token="wrong") as wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model=MODEL, messages=msgs)
        oai = client(ep.base_url)
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=MODEL, messages=[])
        assert err.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=MODEL, messages=msgs, n=3)
        assert err.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2)
        assert err.value.body["param"] == "top_logprobs"
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2=" * 80}])
        assert err.value.code == "context_length_exceeded"
        async with client(f"http://127.0.0.1:{ep.port}/sessions/nope/v1") as gone:
            with pytest.raises(openai.NotFoundError) as err:
                await gone.chat.completions.create(model=MODEL, messages=msgs)
        assert err.value.code == "session_not_found"
        with pytest.raises(openai.APIStatusError) as err:
            await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1" * 5000}])
        assert err.value.status_code == 413
        await oai.close()
        async with httpx.AsyncClient() as http:  # the raw shape every error has
            r = await http.post(f"{ep.base_url}/chat/completions", json={"model": MODEL},
                                headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert ep.counters.errors == {400: 5, 401: 1, 404: 1, 413: 1}
