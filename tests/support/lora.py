"""Shared by the LoRA tests (not fixtures): a tiny Qwen2 wrapped with an adapter, an adapter moved off zero, and
one learner step through ``LocalBackend``."""

from __future__ import annotations

import torch

from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import LearnerConfig
from asyncrl.lora import LoraConfig, LoraReference, apply_lora
from asyncrl.recipes import default_optimizer
from tests.support.algorithms import _model

CONFIG = LoraConfig(rank=4, alpha=8)
LEARNER = LearnerConfig(lr=1e-2)


def lora_model(config: LoraConfig = CONFIG) -> torch.nn.Module:
    """The same tiny Qwen2 every call (seed 0), wrapped with a fresh adapter (seed 1), in train mode."""
    base = _model()
    torch.manual_seed(1)
    return apply_lora(base, config).train()


def nudge_adapter(model: torch.nn.Module, seed: int = 2) -> None:
    """Give every adapter ``B`` (zero when made) random values, so the adapter changes the model's output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)


def backend(model: torch.nn.Module, kl_coef: float = 0.0) -> LocalBackend:
    """A ``LocalBackend`` with the default optimiser and GRPO; with ``kl_coef`` its reference is the base model."""
    loss = GRPOLoss(LossConfig(kl_coef=kl_coef), ref_model=LoraReference() if kl_coef else None)
    return LocalBackend(model, default_optimizer(model, LEARNER), loss, LEARNER)
