"""grpo_pipeline refuses what would otherwise pass silently: an engine sampling in another precision than the
learner computes in by accident (a declared quantization is accepted and reported), and completions longer than
the engine's context."""

from __future__ import annotations

import pytest
import torch

import asyncrl
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.errors import ConfigError
from asyncrl.groups import RewardGroups
from asyncrl.recipes import check_engine_fits, grpo_pipeline

BF16 = BehaviourPrecision("bfloat16")


def _reward(prompt, sample) -> float:  # type: ignore[no-untyped-def]
    return 0.0


def _build(engine, model, config=None):  # type: ignore[no-untyped-def]
    return grpo_pipeline(engine, model, [], RewardGroups(_reward), config or asyncrl.PipelineConfig())


def test_an_engine_in_another_precision_is_refused_naming_both_and_the_fixes():
    with pytest.raises(ConfigError) as err:
        _build(FakeEngine(precision=BF16), torch.nn.Linear(2, 2))
    text = str(err.value)
    assert "samples in bfloat16" in text and "computes in float32" in text
    assert "VLLMEngineConfig(dtype='float32')" in text and "autocast='bfloat16'" in text
    assert "allow_dtype_mismatch=True" in text


@pytest.mark.parametrize("config", [
    asyncrl.PipelineConfig(learner=asyncrl.LearnerConfig(autocast="bfloat16")),  # the learner computes in bf16
    asyncrl.PipelineConfig(allow_dtype_mismatch=True),  # the user accepts the gap
], ids=["autocast", "opt-in"])
def test_autocast_to_the_engines_precision_or_an_explicit_opt_in_is_accepted(config):
    pipe = _build(FakeEngine(precision=BF16), torch.nn.Linear(2, 2), config)
    assert pipe.learner.config.autocast == config.learner.autocast


def test_a_model_loaded_in_the_engines_precision_is_accepted_and_an_unknown_one_is_not_checked():
    _build(FakeEngine(precision=BF16), torch.nn.Linear(2, 2).to(torch.bfloat16))
    _build(FakeEngine(precision=None), torch.nn.Linear(2, 2))  # a server started elsewhere: unknown


@pytest.mark.parametrize("precision", [BehaviourPrecision("bfloat16", quantization="fp8"),
                                       BehaviourPrecision("float32", kv_cache_dtype="fp8")], ids=["fp8", "fp8-kv"])
def test_an_engine_declaring_a_quantization_is_accepted_and_the_pairing_reported(precision, caplog):
    """A declared quantization differs from the learner on purpose (the importance weights correct it): accepted
    without the opt-in, logged at INFO and returned for the run to report."""
    engine = FakeEngine(precision=precision)
    with caplog.at_level("INFO", logger="asyncrl.recipes"):
        pairing = check_engine_fits(engine, torch.nn.Linear(2, 2), asyncrl.PipelineConfig())
        _build(engine, torch.nn.Linear(2, 2))
    assert pairing == (f"fake samples in {precision.describe()}, the learner computes in float32: the importance "
                       "weights correct the gap")
    assert "fp8" in pairing and any(pairing in r.getMessage() and r.levelname == "INFO" for r in caplog.records)


def test_the_pairing_reads_back_for_matching_and_unknown_precisions():
    config = asyncrl.PipelineConfig()
    assert check_engine_fits(FakeEngine(precision=BehaviourPrecision("float32")), torch.nn.Linear(2, 2), config) \
        == "fake samples in float32, as the learner computes"
    assert check_engine_fits(FakeEngine(), torch.nn.Linear(2, 2), config) is None  # a server started elsewhere
    assert BehaviourPrecision("bfloat16", "fp8", "fp8").describe() == "bfloat16, fp8 weights, fp8 KV cache"
    assert not BehaviourPrecision("bfloat16").quantized


def test_max_tokens_beyond_the_context_is_an_error_naming_both_numbers():
    config = asyncrl.PipelineConfig(producer=asyncrl.ProducerConfig(
        sampling=asyncrl.SamplingConfig(max_tokens=300)))
    with pytest.raises(ConfigError, match=r"max_tokens=300 .* context of 256 tokens"):
        _build(FakeEngine(max_model_len=256), torch.nn.Linear(2, 2), config)


@pytest.mark.vllm
async def test_the_real_engine_reports_the_precision_vllm_resolved(vllm_engine, tiny_model_dir):
    from tests.support import engine_config

    assert engine_config(tiny_model_dir).dtype == "float32"
    assert vllm_engine.behaviour_precision == BehaviourPrecision("float32")  # nothing quantized
    with pytest.raises(ConfigError, match="samples in float32 but the learner computes in bfloat16"):
        grpo_pipeline(vllm_engine, torch.nn.Linear(2, 2).to(torch.bfloat16), [], RewardGroups(_reward),
                      close_engine=False)
    model = torch.nn.Linear(2, 2).to(getattr(torch, vllm_engine.behaviour_precision.dtype))
    grpo_pipeline(vllm_engine, model, [], RewardGroups(_reward), asyncrl.PipelineConfig(), close_engine=False)
