"""The engine's share of the GPU (``bench.gpu.engine_share``): vLLM's generated-token counter read off a real
engine, and the split of a sampled counter by the learner's step windows."""

from __future__ import annotations

import pytest

from bench.gpu.engine_share import TokenClock, split, tokens_at


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
