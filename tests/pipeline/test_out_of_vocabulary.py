"""Token ids outside the engine's vocabulary (``Sampler.vocab_size``) are counted drops, never a crashed run: an
environment that appends one (the episode runner drops the group before the context reaches the engine), a prompt
from the prompt source holding one (the producer drops it), and a prompt sent to an engine directly (refused
with ``PromptRejected``, as every other prompt an engine refuses). The fake engine here; the real in-process
engine and a real vLLM server below."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncrl import (
    DropReason, EpisodeConfig, LearnerConfig, PipelineConfig, ProducerConfig, Prompt, PromptRejected, QueueConfig,
    RolloutDropped, SamplingConfig, SyncConfig, grpo_pipeline,
)
from asyncrl.episodes import StepResult
from asyncrl.actors.producer import Producer
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.pool import EnginePool
from asyncrl.engines.supervisor import SupervisedEngine
from asyncrl.episodes import EpisodeGroups, EpisodeRunner
from asyncrl.testing.tasks import arithmetic
from asyncrl.types import Sample
from asyncrl.groups import RewardGroups
from tests.support.episodes import PROMPT, ScriptedEnv
from tests.support import load_hf_model

OOV = 99999  # the id of the report: far outside any tiny model's vocabulary


class Sink:
    def __init__(self) -> None:
        self.sent = []

    async def send(self, group, *, ticket=None):
        self.sent.append(group)
        return True


def _config(n: int = 2) -> ProducerConfig:
    return ProducerConfig(sampling=SamplingConfig(n=n, max_tokens=3), episode=EpisodeConfig(max_turns=4))


# ------------------------------------------------------------------------------------------------ fake engine


async def test_an_environment_id_outside_the_vocabulary_drops_the_group_before_the_engine_sees_it():
    engine = FakeEngine(vocab_size=100)
    made = []

    def factory(prompt):
        made.append(ScriptedEnv(turns=3, ids=(5, 100)))  # 100 is one past the fake's last id
        return made[-1]

    runner = EpisodeRunner(engine, factory, _config(n=2))
    with pytest.raises(RolloutDropped) as info:
        await runner.run_group("g", PROMPT)
    assert info.value.reason is DropReason.OUT_OF_VOCABULARY and "100" in str(info.value), info.value
    assert engine.requests == 2, "one turn per episode; the context with id 100 never reached the engine"
    assert all(e.closed == 1 for e in made)


async def test_a_prompt_outside_the_vocabulary_is_a_counted_drop_and_the_producer_goes_on():
    engine, sink = FakeEngine(vocab_size=100), Sink()
    prompts = PromptSource([Prompt("bad", (1, OOV, 3)), replace(PROMPT, prompt_id="good")])
    producer = Producer(engine, prompts, RewardGroups(lambda p, s: 1.0), sink, _config())
    await producer.run()
    assert producer.counters.dropped == {DropReason.OUT_OF_VOCABULARY: 1}
    assert [g.prompt.prompt_id for g in sink.sent] == ["good"]
    assert engine.requests == 1, "the bad prompt never reached the engine"


async def test_engines_refuse_an_id_outside_their_vocabulary_and_declare_it():
    params = SamplingConfig(n=1, max_tokens=2)
    fake = FakeEngine(vocab_size=100)
    with pytest.raises(PromptRejected) as info:
        await fake.generate((1, 100), params, "r")
    assert not info.value.too_long
    assert len(await fake.generate((1, 99), params, "ok")) == 1
    pool = EnginePool([FakeEngine(vocab_size=100, name="a"), FakeEngine(vocab_size=90, name="b")])
    assert pool.vocab_size == 90, "a pool accepts what every member accepts"
    assert SupervisedEngine(fake, factory=None).vocab_size == 100  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ real engine


class FlaggedEnv:
    """One turn, then done; appends ``OOV`` when the prompt is flagged, a valid id otherwise."""

    def __init__(self, prompt: Prompt) -> None:
        self.ids = (OOV,) if prompt.answer == "flagged" else (7,)

    async def step(self, turn: Sample) -> StepResult:
        return StepResult(self.ids, reward=1.0 if turn.token_ids else 0.0, done=True)

    async def close(self) -> None:
        pass


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_out_of_vocabulary_ids_are_counted_drops_on_the_real_engine(vllm_engine, tokenizer, tiny_model_dir):
    """The issue's run: one prompt from the source and one environment hold id 99999. Both are dropped and
    counted, the run trains its steps, the books balance; none of them reached the engine (that would count an
    ``engine_error``, or, before the fix, crash the run with vLLM's validation error)."""
    train, _ = arithmetic.split(40, 0)
    prompts = [Prompt(f"q{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer) for i, p in enumerate(train)]
    prompts[0] = replace(prompts[0], token_ids=prompts[0].token_ids + (OOV,))
    prompts[1] = replace(prompts[1], answer="flagged")
    config = PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=4), max_inflight_groups=2),
        queue=QueueConfig(capacity=4, max_staleness=2),
        learner=LearnerConfig(batch_groups=2, lr=1e-5, skip_inert_groups=False, sync=SyncConfig(every=1)),
    )
    pipe = grpo_pipeline(vllm_engine, load_hf_model(tiny_model_dir), prompts, EpisodeGroups(FlaggedEnv), config,
                         pad_id=tokenizer.pad_token_id, close_engine=False)
    result = await pipe.run(steps=2)
    assert result.steps == 2 and result.groups_trained == 4
    assert result.dropped.get("out_of_vocabulary") == 2, result.dropped
    assert "engine_error" not in result.dropped, result.dropped
    assert result.unaccounted == 0
    assert not await vllm_engine.llm.is_paused()


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_the_in_process_engine_maps_vllms_validation_error_to_prompt_rejected(vllm_engine):
    """Sent directly (no producer in front), vLLM's ``VLLMValidationError`` becomes ``PromptRejected``, and the
    engine serves the next request."""
    params = SamplingConfig(n=2, max_tokens=2)
    with pytest.raises(PromptRejected) as info:
        await vllm_engine.generate((1, 2, OOV), params, "oov-direct")
    assert not info.value.too_long and str(OOV) in str(info.value)
    assert vllm_engine.vocab_size == 128  # the tiny model's padded vocabulary, above its tokenizer's 96
    with pytest.raises(PromptRejected):
        await vllm_engine.generate((1, 2, vllm_engine.vocab_size), params, "oov-edge")
    assert len(await vllm_engine.generate((1, 2, vllm_engine.vocab_size - 1), params, "in-vocab")) == 2
    assert vllm_engine.llm.output_processor.get_num_unfinished_requests() == 0
