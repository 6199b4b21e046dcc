"""``asyncrl.publish``: one call publishes into an engine driven by hand (no pipeline, no VersionClock of the
caller's), with WeightSync's guarantees: the version moves by one, the engine is resumed whatever happens, and a
cancellation comes through as ``CancelledError`` with the engine's version and weights in agreement."""

from __future__ import annotations

import asyncio

import pytest
import torch

import asyncrl
from asyncrl import PauseMode, SamplingConfig, WeightUpdateError
from asyncrl.algorithms.logprobs import completion_logprobs
from asyncrl.engines.fake import FakeEngine
from tests.support import load_hf_model, perturb

PARITY_ATOL = 2e-3  # float32 engine vs float32 transformers, as in tests/support/vllm_engine.py


async def test_publish_moves_the_version_by_one_from_a_model_or_its_tensors():
    engine = FakeEngine()
    model = torch.nn.Linear(2, 2)
    assert await asyncrl.publish(engine, model) == 1 and engine.version == 1
    assert set(engine.weights) == {"weight", "bias"}
    assert await asyncrl.publish(engine, {"w": torch.zeros(1)}, mode=PauseMode.ABORT, clear_cache=False) == 2
    assert engine.version == 2 and engine._running.is_set(), "resumed"


async def test_a_refused_publication_leaves_the_version_and_the_engine_running():
    engine = FakeEngine()
    with pytest.raises(WeightUpdateError):
        await asyncrl.publish(engine, {"w": "not a tensor"})  # type: ignore[dict-item]
    assert engine.version == 0 and engine._running.is_set()


def _logprobs(model, prompt, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        out = completion_logprobs(model, [prompt] * len(samples), [s.token_ids for s in samples])
    return [out.logprobs[i, : len(s.token_ids)] for i, s in enumerate(samples)]


def _max_diff(model, prompt, samples) -> float:
    return max(float((r - torch.tensor(s.logprobs)).abs().max()) for r, s in zip(_logprobs(model, prompt, samples),
                                                                                    samples))


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_publish_on_the_real_engine(vllm_engine, tokenizer, tiny_model_dir):
    """Perturbed weights published in one call: the engine's log-probs are the new model's, the version moved
    by one, and the engine is resumed (a request completes, nothing left paused)."""
    prompt = tuple(tokenizer("3+4=").input_ids)
    params = SamplingConfig(n=4, max_tokens=8, ignore_eos=True)
    learner = load_hf_model(tiny_model_dir)
    await asyncrl.publish(vllm_engine, learner)  # start equal: earlier tests may have published other weights
    perturb(learner, seed=3)
    stale = await vllm_engine.generate(prompt, params, request_id="publish-stale")
    assert _max_diff(learner, prompt, stale) > 0.05, "the perturbed model must differ from the engine's"
    before = vllm_engine.version
    version = await asyncrl.publish(vllm_engine, learner)
    assert version == before + 1 == vllm_engine.version
    assert not await vllm_engine.llm.is_paused()
    fresh = await vllm_engine.generate(prompt, params, request_id="publish-fresh")
    assert _max_diff(learner, prompt, fresh) < PARITY_ATOL
    assert all(s.oldest_version == s.newest_version == version for s in fresh)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_a_cancelled_publish_leaves_the_engine_resumed_and_consistent(vllm_engine, tokenizer, tiny_model_dir):
    """Cancelled at once (while it prepares) and again after it has paused: ``CancelledError`` each time, the
    engine resumed, and its version is the one whose weights it serves."""
    prompt = tuple(tokenizer("5+6=").input_ids)
    params = SamplingConfig(n=2, max_tokens=6, ignore_eos=True)
    learner = perturb(load_hf_model(tiny_model_dir), seed=4)
    for delay_turns in (0, 50):
        before = vllm_engine.version
        task = asyncio.ensure_future(asyncrl.publish(vllm_engine, learner))
        for _ in range(delay_turns):
            await asyncio.sleep(0)  # loop turns, not time: the task advances through its phases meanwhile
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert vllm_engine.version in (before, before + 1)
        assert not await vllm_engine.llm.is_paused(), "a cancelled publication never leaves the engine paused"
        samples = await vllm_engine.generate(prompt, params, request_id=f"after-cancel-{delay_turns}")
        if vllm_engine.version == before + 1:  # it landed: the engine serves the learner's weights
            assert _max_diff(learner, prompt, samples) < PARITY_ATOL
