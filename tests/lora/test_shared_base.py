"""A LoRA policy's frozen base held in its engine (``asyncrl.lora.share_base``). The engine's side is a real
vLLM worker's CUDA IPC handles (tests/lora/test_lora_gpu.py); here a lent base is laid out as vLLM lays out a
Qwen2 (q, k, v stacked in ``qkv_proj``, gate and up in ``gate_up_proj``, the vocabulary padded to 64 rows) from
the policy's own weights, and the policy mapped onto it must compute what it did, hold none of its base, train
its adapter and leave the base untouched; every refusal names the parameter and changes nothing."""

from __future__ import annotations

import pytest
import torch

from asyncrl.actors.memory import plan_memory
from asyncrl.config import LearnerConfig
from asyncrl.errors import ConfigError
from asyncrl.lora import share_base
from asyncrl.lora.shared_base import LentBase, engine_name
from asyncrl.lora import apply_lora
from tests.support.lora import CONFIG, lora_model, nudge_adapter

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def lent_like_vllm(model: torch.nn.Module, pad_to: int = 64) -> LentBase:
    """``model``'s frozen weights as vLLM holds them with LoRA on: fused by rows, projections wrapped in a
    ``base_layer``, the vocabulary padded, new storage (the names are a real engine's: test_lora_publication.py)."""
    plain = {engine_name(n): p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in plain.items():
        module, _, attr = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused = next((f for f, parts in PACKED.items() if leaf in parts), None)
        if fused is None:
            rows = -(-tensor.shape[0] // pad_to) * pad_to if name.endswith("embed_tokens.weight") else 0
            key = f"{module}.base_layer.{attr}" if leaf.endswith("_proj") else name
            out[key] = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])]) \
                if rows else tensor.clone()
        elif leaf == PACKED[fused][0]:
            out[f"{parent}.{fused}.base_layer.{attr}"] = torch.cat([plain[f"{parent}.{p}.{attr}"]
                                                                    for p in PACKED[fused]])
    return LentBase("lender", out, PACKED)


def _storages(lent: LentBase) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in lent.tensors.values()}


def tiny_policy(tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = apply_lora(Qwen2ForCausalLM(cfg), CONFIG)
    nudge_adapter(model)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_the_policy_runs_on_the_lent_base_and_holds_none_of_it(tied):
    model = tiny_policy(tied)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        before = model(ids).logits
    lent = lent_like_vllm(model)
    assert any(t.shape[0] % 64 == 0 and "embed" in n for n, t in lent.tensors.items()), "the vocabulary is padded"
    adapter = [p for p in model.parameters() if p.requires_grad]
    plan_config = LearnerConfig(memory_budget_gib=1.0)
    static = plan_memory(model, torch.optim.AdamW(adapter), plan_config).static_bytes
    saved = share_base(model, lent)
    after = plan_memory(model, torch.optim.AdamW(adapter), plan_config).static_bytes
    assert static - after == saved, "the memory plan leaves out what the engine holds"
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert saved == sum(p.numel() * p.element_size() for p in frozen)
    assert {p.untyped_storage().data_ptr() for p in frozen} <= _storages(lent), "every frozen weight is the engine's"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    base = model.get_base_model()
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied, "tied weights stay tied, others apart"
    # Training moves the adapter alone; the engine's weights are as they were.
    snapshot = {n: t.clone() for n, t in lent.tensors.items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(ids).logits.sum().backward()
    optimizer.step()
    assert all(p.grad is None for p in frozen)
    assert all(torch.equal(snapshot[n], t) for n, t in lent.tensors.items())
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before), "the adapter trained"


@pytest.mark.parametrize("break_it, named", [
    (lambda t: t.pop("model.layers.0.mlp.down_proj.base_layer.weight"), "model.layers.0.mlp.down_proj.weight: "
                                                                         "engine lender holds no such weight"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}), "model.norm.weight: the policy's is"),
    (lambda t: t.update({"model.layers.1.self_attn.qkv_proj.base_layer.weight":
                         t["model.layers.1.self_attn.qkv_proj.base_layer.weight"][:-2]}),
     "qkv_proj.weight has 126 rows, not the 128"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()}), "load the policy's base in the "
                                                                                  "engine's dtype"),
])
def test_a_base_that_does_not_fit_is_refused_and_nothing_is_replaced(break_it, named):
    model = lora_model()
    lent = lent_like_vllm(model)
    tensors = dict(lent.tensors)
    break_it(tensors)
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        share_base(model, LentBase(lent.engine, tensors, lent.packed))
    assert all(p is before[n] for n, p in model.named_parameters()), "no parameter was replaced"


def test_only_a_lora_policy_takes_a_lent_base():
    from tests.support.algorithms import _model

    with pytest.raises(TypeError, match="apply_lora"):
        share_base(_model(), LentBase("lender", {}, {}))


def test_an_engine_that_cannot_lend_says_why(monkeypatch, tiny_model_dir):
    from asyncrl.engines.lora.transport import LoraServingConfig
    from asyncrl.engines.vllm_local import lending
    from tests.support import engine_config

    monkeypatch.setattr(lending, "is_cpu_platform", lambda: False)  # the conditions a CUDA engine is held to
    serving = LoraServingConfig(max_rank=8)
    assert lending.refusal(engine_config(tiny_model_dir, lora=serving)) is None
    for cfg, field, why in [
        (engine_config(tiny_model_dir), "VLLMEngineConfig.lora", "serves full weights"),
        (engine_config(tiny_model_dir, lora=serving, quantization="fp8"), "VLLMEngineConfig.quantization",
         "serves fp8 weights"),
    ]:
        got = lending.refusal(cfg)
        assert got is not None and got[0] == field and why in got[1]


def test_an_empty_lent_base_names_the_first_weight_it_lacks():
    model = lora_model()
    with pytest.raises(ConfigError, match="engine lender holds no such weight"):
        share_base(model, LentBase("lender", {}, {}))
