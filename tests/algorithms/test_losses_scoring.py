"""Completion scoring and GRPOLoss on a tiny Qwen2 model, checked against a plain forward pass and values worked
out by hand, and the learner's step with them: inert groups skipped, autocast, its own thread."""

from __future__ import annotations

import asyncio
import copy
import math
import os
import sys
import threading

import pytest
import torch

from asyncrl.algorithms import GRPOLoss, LossConfig, completion_logprobs
from asyncrl.config import ConfigError, LearnerConfig, SyncConfig
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan
from tests.support.algorithms import t

# ---------------------------------------------------------------------------------- scoring on a tiny model

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
COMPLETIONS = [[11, 12], [13, 14, 15, 16], [17]]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def _manual(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one row, straight from a full log_softmax over its own forward pass."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[at, completion], -(logp[at].exp() * logp[at]).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_scoring_matches_each_row_alone(model: torch.nn.Module, temperature: float) -> None:
    with torch.no_grad():
        out = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=temperature, pad_id=0,
                                  with_entropy=True)
        assert out.logprobs.shape == (3, 4) and out.logprobs.dtype == torch.float32
        torch.testing.assert_close(out.mask, t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]))
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            alone = completion_logprobs(model, [p], [c], temperature=temperature, with_entropy=True)
            want_logp, want_entropy = _manual(model, p, c, temperature)
            torch.testing.assert_close(out.logprobs[i, : len(c)], alone.logprobs[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.logprobs[i, : len(c)], want_logp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.entropy[i, : len(c)], want_entropy, atol=1e-5, rtol=1e-5)
            assert torch.all(out.logprobs[i, len(c):] == 0)  # padding is 0


def test_temperature_changes_scores(model: torch.nn.Module) -> None:
    with torch.no_grad():
        hot = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=2.0).logprobs
        cold = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0).logprobs
    assert not torch.allclose(hot, cold)


def test_scoring_rejects_empty_prompt(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        completion_logprobs(model, [[]], [[1]])


def _gid_token(gid: str) -> int:
    return 1 + sum(map(ord, gid)) % 40


def _group(gid: str, model: torch.nn.Module, rewards: list[float], shift: float) -> RolloutGroup:
    """Rollouts whose behaviour log-probs are the model's own plus ``shift`` (a stale sampler)."""
    prompt = [_gid_token(gid), 2, 3]
    completions = [[5 + i, 9, 20 + i][: 1 + i % 3] for i in range(len(rewards))]
    with torch.no_grad():
        scored = completion_logprobs(model, [prompt] * len(rewards), completions)
    rollouts = tuple(
        Rollout(Sample(token_ids=tuple(c), logprobs=tuple((scored.logprobs[i, : len(c)] + shift).tolist()),
                       finish_reason=FinishReason.STOP, version_spans=(VersionSpan(0, 0, len(c)),)), reward=r)
        for i, (c, r) in enumerate(zip(completions, rewards))
    )
    return RolloutGroup(group_id=gid, prompt=Prompt(gid, tuple(prompt)), rollouts=rollouts)


def test_grpo_loss_end_to_end(model: torch.nn.Module) -> None:
    groups = [_group("a", model, [1.0, 0.0, 0.5], -0.1), _group("b", model, [0.0, 1.0], 0.05)]
    out = GRPOLoss(LossConfig(entropy_coef=0.01)).compute(model, groups)
    assert torch.isfinite(out.loss) and out.num_tokens == 1 + 2 + 3 + 1 + 2
    model.zero_grad()
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    # rollout-level gauges: rewards (1+0+0.5+0+1)/5 = 0.5; lengths (1+2+3+1+2)/5 = 1.8
    assert out.metrics["train/reward_mean"] == pytest.approx(0.5)
    assert out.metrics["train/completion_len_mean"] == pytest.approx(1.8)
    # behaviour 0.1 below the model on group a's 6 tokens -> weight e^0.1; 0.05 above on group b's 3 -> e^-0.05
    want = (6 * math.exp(0.1) + 3 * math.exp(-0.05)) / 9
    assert out.metrics["loss/ratio_behaviour_mean"] == pytest.approx(want, abs=1e-4)
    model.zero_grad()


def test_uniform_rewards_give_zero_policy_loss(model: torch.nn.Module) -> None:
    groups = [_group("a", model, [1.0, 1.0, 1.0], -0.3), _group("b", model, [0.0, 0.0], 0.2)]
    out = GRPOLoss(LossConfig()).compute(model, groups)
    assert out.loss.item() == 0.0 and out.metrics["loss/policy"] == 0.0
    assert out.metrics["train/adv_abs_mean"] == 0.0


def test_reference_kl_is_zero_against_itself(model: torch.nn.Module) -> None:
    groups = [_group("a", model, [1.0, 0.0], 0.0)]
    out = GRPOLoss(LossConfig(kl_coef=0.05), ref_model=copy.deepcopy(model)).compute(model, groups)
    assert out.metrics["loss/kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="ref_model"):
        GRPOLoss(LossConfig(kl_coef=0.05))


def _learner_step(model: torch.nn.Module, groups: list[RolloutGroup], skip: bool,
                  autocast: str | None = None) -> tuple[torch.nn.Module, dict]:
    """One real learner step (``Learner._train_step``) on a copy of ``model``."""
    from asyncrl.actors.learner import Learner
    from asyncrl.config import LearnerConfig

    copy_ = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(copy_.parameters(), lr=1e-2)
    learner = Learner(copy_, optimizer, GRPOLoss(LossConfig()), *_queue_and_sync(),
                      config=LearnerConfig(micro_batch_rollouts=3, skip_inert_groups=skip, autocast=autocast))
    metrics = learner._train_step(groups)
    return copy_, metrics


@pytest.mark.parametrize("rewards", [[[1.0, 1.0, 1.0], [0.0, 1.0], [0.0, 0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]])
def test_skipping_inert_groups_gives_the_same_step(model: torch.nn.Module, rewards: list[list[float]]) -> None:
    groups = [_group(gid, model, r, -0.1) for gid, r in zip("abc", rewards)]
    assert [GRPOLoss(LossConfig()).inert(g) for g in groups] == [len(set(r)) == 1 for r in rewards]
    skipped, m_skip = _learner_step(model, groups, skip=True)
    full, m_full = _learner_step(model, groups, skip=False)
    for a, b in zip(skipped.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(skipped.parameters(), model.parameters()))  # it did step
    inert = sum(len(set(r)) == 1 for r in rewards) / len(rewards)
    assert m_skip["train/inert_groups_frac"] == pytest.approx(inert) and m_full["train/inert_groups_frac"] == 0
    for key in ("train/reward_mean", "train/completion_len_mean", "train/grad_norm", "loss/total"):
        assert m_skip[key] == pytest.approx(m_full[key], abs=1e-5), key


def test_autocast_runs_the_matmuls_in_bfloat16_and_keeps_the_step(model: torch.nn.Module) -> None:
    """``LearnerConfig(autocast="bfloat16")``: linear layers compute in bf16, the weights stay float32, and the
    step (loss, gradient norm) matches the float32 one to bf16 precision."""
    groups = [_group("a", model, [1.0, 0.0, 0.5], -0.1), _group("b", model, [0.0, 1.0], 0.1)]
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        mixed, m_mixed = _learner_step(model, groups, skip=False, autocast="bfloat16")
    finally:
        hook.remove()
    full, m_full = _learner_step(model, groups, skip=False)
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    for key in ("loss/total", "train/grad_norm"):
        assert m_mixed[key] == pytest.approx(m_full[key], rel=0.05, abs=1e-3), key
    with pytest.raises(ConfigError, match="LearnerConfig.autocast"):
        LearnerConfig(autocast="int8")


def test_kl_or_entropy_terms_make_uniform_groups_count(model: torch.nn.Module) -> None:
    group = _group("a", model, [1.0, 1.0], 0.0)
    assert GRPOLoss(LossConfig()).inert(group)
    assert not GRPOLoss(LossConfig(entropy_coef=0.01)).inert(group)
    assert not GRPOLoss(LossConfig(kl_coef=0.05), ref_model=model).inert(group)


def test_a_batch_of_inert_groups_still_reports_its_loss(model: torch.nn.Module) -> None:
    groups = [_group("a", model, [1.0, 1.0], 0.0), _group("b", model, [0.0, 0.0, 0.0], 0.0)]
    _, metrics = _learner_step(model, groups, skip=True)
    assert metrics["loss/policy"] == metrics["loss/total"] == 0.0 and metrics["train/inert_groups_frac"] == 1.0


@pytest.mark.skipif(not hasattr(os, "setpriority") or not sys.platform.startswith("linux"),
                    reason="per-thread niceness is Linux's")
def test_the_step_runs_in_the_learners_own_thread_at_its_niceness(model: torch.nn.Module) -> None:
    """``LearnerConfig(nice=N)``: every step runs in one thread of the learner's, N above the process's
    niceness; the event loop's thread keeps its own."""
    from asyncrl.actors.learner import Learner

    groups = [_group("a", model, [1.0, 0.0], -0.1)]
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[int, int]] = []

    class Recording(GRPOLoss):
        def compute(self, model_, groups_, **kw):  # type: ignore[no-untyped-def]
            tid = threading.get_native_id()
            seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
            return super().compute(model_, groups_, **kw)

    async def two_steps(nice: int) -> None:
        copy_ = copy.deepcopy(model).train()
        learner = Learner(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-3), Recording(LossConfig()),
                          *_queue_and_sync(), config=LearnerConfig(nice=nice, sync=SyncConfig(every=10)))
        for _ in range(2):
            await learner.train_and_publish(groups)

    asyncio.run(two_steps(5))
    assert len({tid for tid, _ in seen}) == 1 and seen[0][0] != threading.get_native_id()
    assert [n for _, n in seen] == [min(19, base + 5)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # only the learner's thread
    seen.clear()
    asyncio.run(two_steps(0))
    assert [n for _, n in seen] == [base] * 2
    for bad in (-1, 20, 1.5):
        with pytest.raises(ConfigError, match="LearnerConfig.nice"):
            LearnerConfig(nice=bad)  # type: ignore[arg-type]


def _queue_and_sync():
    """The receiving end and weight sync a learner needs, over an in-memory engine (nothing is published)."""
    from asyncrl import QueueConfig, VersionClock, WeightSync
    from asyncrl.queues import create_rollout_queue
    from asyncrl.engines.fake import FakeEngine

    clock = VersionClock()
    _, receiver = create_rollout_queue(QueueConfig(), clock)
    return receiver, WeightSync(FakeEngine(), clock, SyncConfig())
