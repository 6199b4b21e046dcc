"""The engine's share of the GPU (``bench.gpu.engine_share``): vLLM's generated-token counter read off a real
engine, and the split of a sampled counter by the learner's step windows."""

from __future__ import annotations

import pytest

from bench.gpu.engine_share import TokenClock, engine_gauges, split, tokens_at


def test_split_cuts_a_counter_by_the_learner_steps():
    # 100 tokens/s before the first step (0-2 s), 20 tokens/s inside the steps (2-4 s, 5-6 s), 60 between (4-5 s).
    samples = [(0.0, 0.0), (2.0, 200.0), (4.0, 240.0), (5.0, 300.0), (6.0, 320.0)]
    out = split(samples, step_ends=[4.0, 6.0], step_s=[2.0, 1.0], alone_tokens_per_s=200.0)
    assert out["fill"] == {"s": 2.0, "tokens": 200.0, "tokens_per_s": 100.0, "of_alone": 0.5}
    assert out["training"]["s"] == 3.0 and out["training"]["tokens"] == 60.0
    assert out["training"]["tokens_per_s"] == pytest.approx(20.0)
    assert out["between"] == {"s": 1.0, "tokens": 60.0, "tokens_per_s": 60.0, "of_alone": 0.3}
    assert out["span_s"] == 6.0 and out["tokens"] == 320.0
    assert tokens_at(samples, 1.0) == 100.0 and tokens_at(samples, 9.0) == 320.0
    assert all("running" not in out[phase] for phase in ("fill", "training", "between")), "pairs hold no gauge"


def test_split_averages_the_running_requests_of_each_phase():
    # Third field: requests running. 8 before the first step, 2 and 4 inside the steps, 6 between. A sample on a
    # boundary belongs to the phase it opens (the last one, at the last step's end, to none).
    samples = [(0.0, 0.0, 8), (1.0, 100.0, 8), (2.0, 200.0, 2), (3.0, 220.0, 2), (4.5, 270.0, 6), (5.5, 310.0, 4),
               (6.0, 320.0, 1)]
    out = split(samples, step_ends=[4.0, 6.0], step_s=[2.0, 1.0])
    assert out["fill"]["running"] == 8.0, "the samples at 0 and 1 s"
    assert out["training"]["running"] == pytest.approx((2 + 2 + 4) / 3), "the samples at 2, 3 and 5.5 s"
    assert out["between"]["running"] == 6.0, "the sample at 4.5 s"
    # The counter at 4 s and 5 s lies between samples: 220 + 50 / 1.5 and 270 + 40 / 2.
    assert out["training"]["tokens"] == pytest.approx((220 + 50 / 1.5 - 200) + (320 - 290))


def test_split_needs_samples_and_a_step():
    assert split([(0.0, 0.0)], [1.0], [0.5]) is None
    assert split([(0.0, 0.0), (1.0, 5.0)], [], []) is None


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_the_clock_counts_what_the_engine_generates(vllm_engine, tokenizer):
    import asyncrl

    ids = tuple(tokenizer("12+7=").input_ids)
    async with TokenClock(t0=0.0, period_s=0.05) as clock:
        samples = await vllm_engine.generate(ids, asyncrl.SamplingConfig(n=3, max_tokens=12), "share-clock")
    made = sum(len(s.token_ids) for s in samples)
    assert made > 0
    assert clock.samples[-1][1] - clock.samples[0][1] == made, "the counter moved by exactly the tokens generated"


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_the_running_gauge_counts_the_requests_in_flight(vllm_engine, tokenizer):
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from tests.support.vllm_engine import _first_token_seen

    ids = list(tokenizer("12+7=").input_ids)
    started = [asyncio.Event() for _ in range(3)]

    async def long(i: int) -> None:  # cannot end for 200 tokens
        sp = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async for _ in vllm_engine.llm.generate({"prompt_token_ids": ids}, sp, request_id=f"share-running-{i}"):
            started[i].set()

    tasks = [asyncio.create_task(long(i)) for i in range(3)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
        await _first_token_seen(vllm_engine)  # a step with all three running has set the gauge since
        assert not any(t.done() for t in tasks), "200 tokens outlast a few steps"
        tokens, running = engine_gauges()
        assert running >= 3, f"the gauge read {running} with three long requests in flight"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
