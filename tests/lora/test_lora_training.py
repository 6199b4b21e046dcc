"""Training a LoRA policy: the optimiser holds the adapter alone, a learner step moves nothing else, the base
model is the KL reference for free, and a checkpoint holds the adapter and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.algorithms import completion_logprobs
from asyncrl.algorithms.reference import reference_logprobs
from asyncrl.checkpoint import CheckpointConfig, Checkpointer, TrainingState, restore
from asyncrl.checkpoint.weights import ADAPTER_FILE
from asyncrl.counters import GroupTotals
from asyncrl.engines.weights import WEIGHTS_FILE
from asyncrl.lora import LoraReference, adapter_state
from asyncrl.recipes import default_optimizer
from tests.support.algorithms import BATCH, COMPLETIONS, PROMPTS, _model
from tests.support.lora import LEARNER, backend, lora_model


def test_the_optimiser_holds_exactly_the_adapter_parameters():
    model = lora_model()
    groups = default_optimizer(model, LEARNER).param_groups
    held = {id(p) for g in groups for p in g["params"]}
    adapter = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert held == adapter and len(adapter) == 28


def test_full_fine_tuning_still_optimises_every_parameter():
    model = _model()
    held = [p for g in default_optimizer(model, LEARNER).param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        default_optimizer(model, LEARNER)


def test_a_learner_step_changes_the_adapter_and_nothing_else():
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = backend(model).train_step(BATCH, 0)
    assert metrics["train/grad_norm"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at zero: the step has to move it for A to matter


def test_the_reference_is_the_base_model_and_the_policy_moves_away_from_it():
    base_logp = completion_logprobs(_model(), PROMPTS, COMPLETIONS).logprobs
    model = lora_model()
    trainer = backend(model, kl_coef=0.1)
    first = trainer.train_step(BATCH, 0)
    assert first["loss/kl"] == 0.0  # a fresh adapter: policy == reference
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    second = trainer.train_step(BATCH, 1)
    assert second["loss/kl"] > 0
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    ref = reference_logprobs(LoraReference(), model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=0)
    with torch.no_grad():
        policy = completion_logprobs(model, PROMPTS, COMPLETIONS).logprobs
    torch.testing.assert_close(ref, base_logp.detach(), rtol=0, atol=1e-6)
    assert (policy - ref).abs().max() > 1e-4


async def test_checkpoint_holds_the_adapter_alone_and_resumes_exactly(tmp_path):
    model = lora_model()
    trainer = backend(model)
    for step in range(2):
        trainer.train_step(BATCH, step)
    state = TrainingState(step=2, version=2, published=True, cursor=0, counters=GroupTotals())
    async with Checkpointer(CheckpointConfig(tmp_path, every_steps=1)) as ckpt:
        saved = await ckpt.save(model, trainer.optimizer, state)
    assert (saved.path / ADAPTER_FILE).is_file() and not (saved.path / WEIGHTS_FILE).exists()
    assert saved.meta["weights"] == "adapter"

    fresh = lora_model()
    resumed = backend(fresh)
    assert restore(saved, fresh, resumed.optimizer).step == 2
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n
    a, b = trainer.train_step(BATCH, 2), resumed.train_step(BATCH, 2)
    assert a["loss/total"] == b["loss/total"] and a["train/grad_norm"] == b["train/grad_norm"]
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n


async def test_an_adapter_checkpoint_and_a_plain_model_do_not_mix(tmp_path):
    model = lora_model()
    state = TrainingState(step=1, version=1, published=True, cursor=0, counters=GroupTotals())
    async with Checkpointer(CheckpointConfig(tmp_path / "lora")) as ckpt:
        saved = await ckpt.save(model, default_optimizer(model, LEARNER), state)
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        restore(saved, _model())
    plain = _model()
    async with Checkpointer(CheckpointConfig(tmp_path / "full")) as ckpt:
        full = await ckpt.save(plain, default_optimizer(plain, LEARNER), state)
    with pytest.raises(ValueError, match="holds full weights"):
        restore(full, lora_model())
    assert set(load_file(str(saved.path / ADAPTER_FILE))) == set(adapter_state(model))
