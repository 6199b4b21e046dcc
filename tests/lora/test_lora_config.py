"""``LoraConfig``: defaults that fit Llama/Qwen2 decoders, and errors that name the field."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError
from asyncrl.lora import DEFAULT_TARGETS, LoraConfig


def test_defaults_target_the_attention_and_mlp_projections():
    cfg = LoraConfig()
    assert cfg.target_modules == DEFAULT_TARGETS
    assert set(cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (cfg.rank, cfg.alpha, cfg.dropout) == (16, 32, 0.0)


def test_a_list_of_targets_is_kept_as_a_tuple():
    assert LoraConfig(target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("kwargs, name", [
    ({"rank": 0}, "LoraConfig.rank"),
    ({"rank": 2.0}, "LoraConfig.rank"),
    ({"alpha": 0}, "LoraConfig.alpha"),
    ({"target_modules": ()}, "LoraConfig.target_modules"),
    ({"target_modules": ("model.q_proj",)}, "LoraConfig.target_modules.0"),
    ({"dropout": 1.0}, "LoraConfig.dropout"),
    ({"dropout": -0.1}, "LoraConfig.dropout"),
    ({"ranks": 4}, "LoraConfig.ranks"),
])
def test_bad_values_name_the_field(kwargs, name):
    with pytest.raises(ConfigError) as info:
        LoraConfig(**kwargs)
    assert info.value.field == name
