"""Admission on the real vLLM engine: a long group started in time survives several publications in keep mode
(its samples carry the versions they crossed) and is trained, not dropped as stale."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from asyncrl import LearnerConfig, PauseMode, PipelineConfig, ProducerConfig, QueueConfig, SamplingConfig, SyncConfig
from asyncrl.actors.producer import Producer
from asyncrl.data import PromptSource
from asyncrl.groups import RewardGroups
from tests.support.pipelines import Recording, build, reward, task_prompts

pytestmark = pytest.mark.vllm


class Versions(Recording):
    """Records, per trained group, its staleness and the versions its tokens were sampled under."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.trained: dict[str, tuple[int, set[int]]] = {}

    def compute(self, model, groups, **kw):
        for g in groups:
            versions = {span.version for r in g.rollouts for span in r.sample.version_spans}
            self.trained[g.group_id] = (g.staleness(self.learner.policy_version), versions)
        return super().compute(model, groups, **kw)


def config(max_tokens: int, max_staleness: int) -> PipelineConfig:
    return PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=max_tokens, ignore_eos=True),
                                max_inflight_groups=2),
        queue=QueueConfig(capacity=4, max_staleness=max_staleness),
        learner=LearnerConfig(batch_groups=1, lr=1e-4, skip_inert_groups=False,
                              sync=SyncConfig(every=1, mode=PauseMode.KEEP)))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_long_group_started_in_time_crosses_publications_and_is_trained(vllm_engine, tiny_model_dir,
                                                                               tokenizer):
    loss = Versions(tokenizer)
    pipe = build(vllm_engine, tiny_model_dir, tokenizer, config(max_tokens=2, max_staleness=4), loss)
    started = pipe.learner.version
    published = asyncio.Event()  # the long group starts once short groups have moved the version
    pipe.learner.weight_sync.clock.observe(lambda c: published.set() if c.served > started else None)
    long_prompt = dataclasses.replace(task_prompts(tokenizer, 10)[0], prompt_id="long")

    async def one_long_prompt():
        await published.wait()
        yield long_prompt

    short = pipe.producers[0]
    long_cfg = config(max_tokens=200, max_staleness=4).producer
    pipe.producers.append(Producer(vllm_engine, PromptSource(one_long_prompt()), RewardGroups(reward),
                                   short.sink.clone(), long_cfg,
                                   name="long", admission=short.admission))
    stats = await asyncio.wait_for(pipe.run(steps=10), 240)
    long_id = f"{long_prompt.prompt_id}#0"
    assert long_id in loss.trained, f"the long group was not trained; drops: {stats.dropped}"
    staleness, versions = loss.trained[long_id]
    assert len(versions) >= 3, f"it crossed publications in flight (keep mode): versions {sorted(versions)}"
    assert staleness <= 4
    assert "stale" not in stats.dropped and stats.unaccounted == 0
