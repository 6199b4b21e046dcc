"""``asyncrl.lora.model`` on a tiny Qwen2: only the adapter trains, its tensors round-trip, the base model serves
as the reference with no second copy, and both exports load back to the same numbers."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms import completion_logprobs
from asyncrl.config import ConfigError
from asyncrl.lora import (
    LoraConfig, LoraReference, adapter_state, apply_lora, export_adapter, export_merged, is_lora,
    load_adapter_state, merged_state, reference_context,
)
from tests.support.algorithms import COMPLETIONS, PROMPTS, _model
from tests.support.lora import CONFIG, lora_model, nudge_adapter

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])


def logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapter_trains_and_a_fresh_adapter_changes_nothing():
    base = _model()
    before = logits(base)
    model = apply_lora(base, CONFIG)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2  # layers x targeted projections x (A, B)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert is_lora(model) and not is_lora(_model())
    torch.testing.assert_close(logits(model.eval()), before, rtol=0, atol=0)


def test_a_target_that_matches_nothing_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="w_proj") as info:
        apply_lora(_model(), LoraConfig(target_modules=("q_proj", "w_proj")))
    assert info.value.field == "LoraConfig.target_modules"


def test_adapter_state_round_trips_under_peft_file_names():
    model = lora_model()
    nudge_adapter(model)
    state = adapter_state(model)
    assert len(state) == 28 and all(".default." not in k and ".lora_" in k for k in state)
    fresh = lora_model()
    load_adapter_state(fresh, {k: v.clone() for k, v in state.items()})
    torch.testing.assert_close(logits(fresh.eval()), logits(model.eval()), rtol=0, atol=0)


def test_load_adapter_state_refuses_other_names_or_shapes():
    model = lora_model()
    state = adapter_state(lora_model())
    with pytest.raises(ValueError, match="missing"):
        load_adapter_state(model, dict(list(state.items())[1:]))
    with pytest.raises(ValueError, match="shape"):
        load_adapter_state(model, adapter_state(lora_model(LoraConfig(rank=2, alpha=8))))


def test_reference_context_scores_as_the_base_model_and_leaves_grad_flags_as_they_were():
    base_logp = completion_logprobs(_model(), PROMPTS, COMPLETIONS).logprobs.detach()
    model = lora_model()
    nudge_adapter(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        with reference_context(model) as ref:
            under = completion_logprobs(ref, PROMPTS, COMPLETIONS).logprobs
        policy = completion_logprobs(model, PROMPTS, COMPLETIONS).logprobs
    torch.testing.assert_close(under, base_logp, rtol=0, atol=1e-6)
    assert (policy - base_logp).abs().max() > 1e-3
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_a_lora_reference_for_a_model_without_an_adapter_is_an_error():
    with pytest.raises(TypeError, match="apply_lora"):
        with LoraReference().scope(_model()):
            pass


def test_export_adapter_loads_back_with_peft(tmp_path):
    from peft import PeftModel

    model = lora_model()
    nudge_adapter(model)
    out = export_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(_model(), str(out))
    torch.testing.assert_close(logits(loaded.eval()), logits(model.eval()), rtol=0, atol=1e-6)


def test_export_merged_is_a_plain_model_equal_to_base_plus_adapter(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32), CONFIG)
    nudge_adapter(model)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    out = export_merged(model, tmp_path / "merged", tokenizer=tokenizer)
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())  # the live model is untouched
    assert (out / "tokenizer_config.json").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not is_lora(merged) and set(merged.state_dict()) == set(merged_state(model))
    torch.testing.assert_close(logits(merged), logits(model.eval()), rtol=1e-5, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    assert (logits(merged) - logits(base)).abs().max() > 1e-3  # the adapter is in it
