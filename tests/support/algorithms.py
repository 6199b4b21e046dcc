"""Shared by the loss and learner-step tests (not fixtures): ``t``, a float32 tensor written as nested lists; and
for the packing and varlen tests, a tiny Qwen2, sequences that pack, a batch of groups, one ``LocalBackend`` step
on a copy of a model, and the comparison of two such steps."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import LearnerConfig
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, requires_grad=grad)


# Lengths 8, 3, 4, 3, 5, 2: at the default row width (the longest, 8) they pack into 4 rows, not 6.
PROMPTS = [[1, 2, 3, 4, 5], [4, 5], [6, 7, 8], [11], [3, 3, 9], [7]]
COMPLETIONS = [[11, 12, 13], [13], [17], [5, 6], [8, 9], [30]]


def _model(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).eval()


def _group(gid: str, prompt_len: int, lengths: list[int]) -> RolloutGroup:
    base = 1 + sum(map(ord, gid)) % 20
    rollouts = tuple(
        Rollout(Sample(tuple((base + 3 * i + j) % 48 + 1 for j in range(n)), tuple(-2.0 - 0.1 * j for j in range(n)),
                       FinishReason.STOP, (VersionSpan(0, 0, n),)), reward=float(i % 2))
        for i, n in enumerate(lengths))
    return RolloutGroup(gid, Prompt(gid, tuple((base + k) % 48 + 1 for k in range(prompt_len))), rollouts)


BATCH = [_group("a", 3, [2, 9, 4]), _group("b", 6, [1, 3]), _group("c", 2, [7, 7, 2, 5]), _group("d", 4, [3, 1])]


def _step(model: torch.nn.Module, cfg: LearnerConfig) -> tuple[torch.nn.Module, dict[str, float], int]:
    """One LocalBackend step on a copy of ``model``; returns the copy, the metrics and the number of passes."""
    calls = [0]

    class Counting(GRPOLoss):
        def compute(self, model_, groups_, **kw):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return super().compute(model_, groups_, **kw)

    trained = copy.deepcopy(model).train()
    backend = LocalBackend(trained, torch.optim.SGD(trained.parameters(), lr=0.1), Counting(LossConfig()), cfg)
    return trained, backend.train_step(BATCH, 0), calls[0]


def _assert_same_step(a: tuple, b: tuple, atol: float = 1e-6) -> None:  # type: ignore[type-arg]
    # loss/total is exact over micro-batches; per-chunk gauges such as train/adv_abs_mean are group-weighted
    # averages of chunk means, so they shift with the chunking by design and are not compared.
    for key in ("loss/total", "train/grad_norm"):
        assert a[1][key] == pytest.approx(b[1][key], abs=atol), key
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5)
