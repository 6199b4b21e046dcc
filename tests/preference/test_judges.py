"""Pairwise judges and the producer's judge scoring: the adapters (a reward, a reward model in its own thread, a
real HTTP judge on loopback), round-robin scores, opponents, and every failure as a counted drop reason."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from aiohttp import web

from asyncrl import ProducerConfig, SamplingConfig
from asyncrl.groups.scoring import RewardRejected
from asyncrl.config import ConfigError
from asyncrl.engines.fake import FakeEngine
from asyncrl.errors import NoProgressError
from asyncrl.preference import HttpJudge, JudgedGroups, RewardModelJudge, judge_from_reward
from asyncrl.types import DropReason, FinishReason, Prompt, Sample, VersionSpan

PROMPT = Prompt("p", (1, 2), "2+2=", answer="4")


def sample(text: str, ids: tuple[int, ...] = (5,)) -> Sample:
    return Sample(ids, (-1.0,) * len(ids), FinishReason.STOP, (VersionSpan(0, 0, len(ids)),), text)


def by_length(prompt, a, b):
    return 0.5 if len(a.token_ids) == len(b.token_ids) else float(len(a.token_ids) > len(b.token_ids))


def producer_config(**kw) -> ProducerConfig:
    return ProducerConfig(sampling=SamplingConfig(n=kw.pop("n", 3), max_tokens=4), **kw)


# -- adapters ---------------------------------------------------------------------------------------------------


def test_judge_from_reward_prefers_the_higher_reward_and_ties_within_the_margin():
    judge = judge_from_reward(lambda p, s: float(s.text == p.answer))
    assert judge(PROMPT, sample("4"), sample("5")) == 1.0
    assert judge(PROMPT, sample("5"), sample("4")) == 0.0
    assert judge(PROMPT, sample("6"), sample("5")) == 0.5
    close = judge_from_reward(lambda p, s: float(len(s.text)), margin=1.0)
    assert close(PROMPT, sample("ab"), sample("a")) == 0.5 and close(PROMPT, sample("abc"), sample("a")) == 1.0
    with pytest.raises(ConfigError, match="margin"):
        judge_from_reward(lambda p, s: 0.0, margin=-1)


@pytest.mark.asyncio
async def test_an_async_reward_gives_an_async_judge():
    async def reward(prompt, s):
        await asyncio.sleep(0)
        return float(s.text == prompt.answer)

    judge = judge_from_reward(reward)
    assert await judge(PROMPT, sample("5"), sample("4")) == 0.0


@pytest.mark.asyncio
async def test_reward_model_judge_is_bradley_terry_on_its_scores_off_the_event_loop(tiny_model_dir, tokenizer):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(str(tiny_model_dir), num_labels=1)
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg)
    judge = RewardModelJudge(model, tokenizer)
    threads = []
    scores = judge.scores
    judge.scores = lambda texts: threads.append(threading.current_thread()) or scores(texts)  # type: ignore[method-assign]
    try:
        p = await judge(PROMPT, sample("4"), sample("17"))
        sa, sb = scores(["2+2=4", "2+2=17"])
        assert p == pytest.approx(1 / (1 + math.exp(-(sa - sb))), rel=1e-6) and 0 < p < 1
        assert threads and threads[0] is not threading.main_thread()
    finally:
        judge.close()
    bad = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(str(tiny_model_dir),
                                                                                      num_labels=2))
    with pytest.raises(ConfigError, match="one output"):
        RewardModelJudge(bad, tokenizer)


@pytest.fixture
async def judge_server():
    """A judge service on loopback: the winner depends on the texts, or the service misbehaves on demand."""
    async def handle(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer s3cret"
        body = await request.json()
        if body["a"] == "crash":
            return web.json_response({"error": "judge overloaded"}, status=503)
        if body["a"] == "odd":
            return web.json_response({"verdict": "a"})
        if body["a"] == "p":
            return web.json_response({"p": 0.25})
        return web.json_response({"winner": "a" if body["a"] == body["prompt"][-1:] else "b"})

    app = web.Application()
    app.router.add_post("/judge", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.asyncio
async def test_http_judge_reads_a_winner_or_a_probability_and_raises_on_anything_else(judge_server):
    judge = HttpJudge(judge_server, "s3cret")
    try:
        prompt = Prompt("q", (1,), "say x")
        assert await judge(prompt, sample("x"), sample("y")) == 1.0
        assert await judge(prompt, sample("y"), sample("x")) == 0.0
        assert await judge(prompt, sample("p"), sample("x")) == 0.25
        with pytest.raises(RuntimeError, match="503: judge overloaded"):
            await judge(prompt, sample("crash"), sample("x"))
        with pytest.raises(RuntimeError, match="neither a number 'p' nor a 'winner'"):
            await judge(prompt, sample("odd"), sample("x"))
    finally:
        await judge.close()


# -- scoring ----------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_robin_scores_are_mean_win_probabilities():
    scorer = JudgedGroups(by_length)
    samples = [sample("a", (1,)), sample("abc", (1, 2, 3)), sample("ab", (1, 2))]
    scores, opponents = await scorer.score("g", PROMPT, samples, producer_config())
    assert scores == [0.0, 1.0, 0.5] and opponents == ()
    assert scorer.counters.comparisons == 3 and scorer.counters.groups == 1


@pytest.mark.asyncio
async def test_a_group_of_ties_is_dropped_and_counted_as_a_tie():
    scorer = JudgedGroups(by_length)
    with pytest.raises(RewardRejected) as info:
        await scorer.score("g", PROMPT, [sample("a"), sample("b")], producer_config(n=2))
    assert info.value.reason is DropReason.PREFERENCE_TIE
    assert scorer.counters.ties == 1 and scorer.counters.groups == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [1.5, -0.1, math.nan, "a", None])
async def test_a_judge_answer_that_is_not_a_probability_drops_the_group(value):
    scorer = JudgedGroups(lambda p, a, b: value)
    with pytest.raises(RewardRejected) as info:
        await scorer.score("g", PROMPT, [sample("a"), sample("b")], producer_config(n=2))
    assert info.value.reason is DropReason.JUDGE_INVALID and "not a probability" in str(info.value)


@pytest.mark.asyncio
async def test_a_judge_that_raises_drops_the_group_as_judge_error():
    def judge(p, a, b):
        raise KeyError("model unavailable")

    with pytest.raises(RewardRejected) as info:
        await JudgedGroups(judge).score("g", PROMPT, [sample("a"), sample("b")], producer_config(n=2))
    assert info.value.reason is DropReason.JUDGE_ERROR and "pairwise judge raised" in str(info.value)


@pytest.mark.asyncio
async def test_a_judge_that_hangs_times_out_and_hung_threads_stop_the_run():
    never = asyncio.Event()

    async def hanging(p, a, b):
        await never.wait()

    with pytest.raises(RewardRejected) as info:
        await JudgedGroups(hanging).score("g", PROMPT, [sample("a"), sample("b")],
                                          producer_config(n=2, reward_timeout_s=0.2))
    assert info.value.reason is DropReason.JUDGE_TIMEOUT

    release = threading.Event()
    scorer = JudgedGroups(lambda p, a, b: release.wait(30) and 1.0)
    limits = producer_config(n=2, reward_timeout_s=0.2, reward_threads=1)
    try:
        with pytest.raises(RewardRejected):
            await scorer.score("g", PROMPT, [sample("a"), sample("b")], limits)
        with pytest.raises(NoProgressError, match="pairwise judge hangs"):
            await scorer.score("g", PROMPT, [sample("a"), sample("b")], limits)
    finally:
        release.set()


@pytest.mark.asyncio
async def test_against_an_opponent_each_completion_meets_one_of_the_opponents():
    opponent = FakeEngine(length_fn=lambda prompt, i: 2)
    scorer = JudgedGroups(by_length, opponent=opponent)
    samples = [sample("a", (1,)), sample("abc", (1, 2, 3)), sample("ab", (1, 2))]
    scores, opponents = await scorer.score("g", PROMPT, samples, producer_config(n=3))
    assert [len(o.token_ids) for o in opponents] == [2, 2, 2]
    assert scores == [0.0, 1.0, 0.5]
    m = scorer.metrics()
    assert m["judge/win_rate"] == pytest.approx(0.5) and m["judge/opponent_samples"] == 3
    dropped = JudgedGroups(by_length, opponent=opponent, keep_opponents=False)
    assert (await dropped.score("g", PROMPT, samples, producer_config(n=3)))[1] == ()
