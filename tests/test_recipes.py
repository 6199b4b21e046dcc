"""grpo_pipeline refuses what would otherwise pass silently: an engine sampling in another precision than the
learner computes in, and completions longer than the engine's context."""

from __future__ import annotations

import pytest
import torch

import asyncrl
from asyncrl.engines.fake import FakeEngine
from asyncrl.errors import ConfigError
from asyncrl.recipes import grpo_pipeline
from asyncrl.groups import RewardGroups


def _reward(prompt, sample) -> float:  # type: ignore[no-untyped-def]
    return 0.0


def _build(engine, model, config=None):  # type: ignore[no-untyped-def]
    return grpo_pipeline(engine, model, [], RewardGroups(_reward), config or asyncrl.PipelineConfig())


def test_an_engine_in_another_precision_is_refused_naming_both_and_the_fixes():
    with pytest.raises(ConfigError) as err:
        _build(FakeEngine(serving_dtype="bfloat16"), torch.nn.Linear(2, 2))
    text = str(err.value)
    assert "samples in bfloat16" in text and "computes in float32" in text
    assert "VLLMEngineConfig(dtype='float32')" in text and "autocast='bfloat16'" in text
    assert "allow_dtype_mismatch=True" in text


@pytest.mark.parametrize("config", [
    asyncrl.PipelineConfig(learner=asyncrl.LearnerConfig(autocast="bfloat16")),  # the learner computes in bf16
    asyncrl.PipelineConfig(allow_dtype_mismatch=True),  # the user accepts the gap
], ids=["autocast", "opt-in"])
def test_autocast_to_the_engines_precision_or_an_explicit_opt_in_is_accepted(config):
    pipe = _build(FakeEngine(serving_dtype="bfloat16"), torch.nn.Linear(2, 2), config)
    assert pipe.learner.config.autocast == config.learner.autocast


def test_a_model_loaded_in_the_engines_precision_is_accepted_and_an_unknown_one_is_not_checked():
    _build(FakeEngine(serving_dtype="bfloat16"), torch.nn.Linear(2, 2).to(torch.bfloat16))
    _build(FakeEngine(serving_dtype=None), torch.nn.Linear(2, 2))  # a server started elsewhere: unknown


def test_max_tokens_beyond_the_context_is_an_error_naming_both_numbers():
    config = asyncrl.PipelineConfig(producer=asyncrl.ProducerConfig(
        sampling=asyncrl.SamplingConfig(max_tokens=300)))
    with pytest.raises(ConfigError, match=r"max_tokens=300 .* context of 256 tokens"):
        _build(FakeEngine(max_model_len=256), torch.nn.Linear(2, 2), config)


@pytest.mark.vllm
async def test_the_real_engine_reports_the_precision_vllm_resolved(vllm_engine, tiny_model_dir):
    from tests.support import engine_config

    assert engine_config(tiny_model_dir).dtype == "float32"
    assert vllm_engine.serving_dtype == "float32"
    with pytest.raises(ConfigError, match="samples in float32 but the learner computes in bfloat16"):
        grpo_pipeline(vllm_engine, torch.nn.Linear(2, 2).to(torch.bfloat16), [], RewardGroups(_reward),
                      close_engine=False)
    model = torch.nn.Linear(2, 2).to(getattr(torch, vllm_engine.serving_dtype))
    grpo_pipeline(vllm_engine, model, [], RewardGroups(_reward), asyncrl.PipelineConfig(), close_engine=False)
