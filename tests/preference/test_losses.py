"""The preference losses against a direct computation: sequence log-probs summed from a plain forward pass of
the model (no asyncrl scoring code), then the DPO / IPO / XPO / Nash-MD formulas written out, values and
gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from asyncrl.config import ConfigError
from asyncrl.preference import (
    OPPONENTS, NashMDLoss, OnlineDPOLoss, PreferenceConfig, XPOLoss, dpo_losses, nash_md_losses,
)
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan
from tests.support.algorithms import _model


def sample(ids: list[int], logprobs: list[float] | None = None) -> Sample:
    lp = logprobs or [-1.0] * len(ids)
    return Sample(tuple(ids), tuple(lp), FinishReason.STOP, (VersionSpan(0, 0, len(ids)),))


def direct_logps(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[torch.Tensor]:
    """Per-token log-probs of ``completion`` after ``prompt``, from one forward pass of the whole sequence."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()
    logp = F.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(completion)]


def seq(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    return torch.stack(direct_logps(model, prompt, completion)).sum()


@pytest.fixture(scope="module")
def models():
    policy = _model()
    ref = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # move the policy away from the reference so the margins are not zero
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref


GROUPS = [
    RolloutGroup("g0", Prompt("g0", (1, 2, 3)), (Rollout(sample([5, 6, 7]), 0.25), Rollout(sample([8, 9]), 1.0),
                                                Rollout(sample([10]), 0.0), Rollout(sample([11, 12]), 0.5))),
    RolloutGroup("g1", Prompt("g1", (4, 5)), (Rollout(sample([13, 14]), 0.0), Rollout(sample([15, 16, 17]), 1.0))),
]


def grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return [g if g is not None else torch.zeros_like(p) for p, g in
            zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_is_dpo_on_the_best_and_the_worst_of_each_group(models, loss_type):
    policy, ref = models
    beta = 0.3
    loss = OnlineDPOLoss(PreferenceConfig(beta=beta, loss_type=loss_type), ref)
    out = loss.compute(policy, GROUPS)
    terms = []
    for prompt, chosen, rejected in (([1, 2, 3], [8, 9], [10]), ([4, 5], [15, 16, 17], [13, 14])):
        h = (seq(policy, prompt, chosen) - seq(ref, prompt, chosen)) - (
            seq(policy, prompt, rejected) - seq(ref, prompt, rejected))
        terms.append(-F.logsigmoid(beta * h) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2)
    expected = torch.stack(terms).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(grads(policy, out.loss), grads(policy, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert out.num_tokens == sum(g.num_tokens for g in GROUPS)
    assert 0.0 <= float(out.metrics["pref/accuracy"]) <= 1.0


def test_dpo_losses_formula_and_its_limits():
    c, r = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    losses, h = dpo_losses(c, r, rc, rr, beta=0.5)
    torch.testing.assert_close(h, torch.tensor([1.0, -2.0]))  # (c - ref c) - (r - ref r)
    torch.testing.assert_close(losses, torch.tensor([math.log1p(math.exp(-0.5)), math.log1p(math.exp(1.0))]))
    ipo, _ = dpo_losses(c, r, rc, rr, beta=0.5, loss_type="ipo")
    torch.testing.assert_close(ipo, torch.tensor([0.0, 9.0]))  # (h - 1/(2 beta))^2, the margin being 1


def test_xpo_orients_each_pair_by_the_judge_and_adds_the_exploration_term(models):
    policy, ref = models
    beta, alpha = 0.2, 0.05
    refs = (sample([20, 21]), sample([22]))
    group = RolloutGroup("x", Prompt("x", (1, 2, 3)), (Rollout(sample([5, 6]), 1.0), Rollout(sample([7]), 0.0)),
                         companions={OPPONENTS: refs})
    tied = RolloutGroup("t", Prompt("t", (4,)), (Rollout(sample([9, 9]), 0.5),),
                         companions={OPPONENTS: (sample([3]),)})
    out = XPOLoss(PreferenceConfig(beta=beta, alpha=alpha), ref).compute(policy, [group, tied])
    pairs = [([1, 2, 3], [5, 6], [20, 21]), ([1, 2, 3], [22], [7])]  # the second completion lost to the reference
    def margin(p, c, r):
        return (seq(policy, p, c) - seq(ref, p, c)) - (seq(policy, p, r) - seq(ref, p, r))

    dpo = torch.stack([-F.logsigmoid(beta * margin(p, c, r)) for p, c, r in pairs]).mean()  # ties add nothing
    explore = alpha * torch.stack([seq(policy, [1, 2, 3], [20, 21]), seq(policy, [1, 2, 3], [22]),
                                   seq(policy, [4], [3])]).mean()
    expected = dpo + explore
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(grads(policy, out.loss), grads(policy, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_xpo_refuses_a_group_without_its_reference_completions(models):
    policy, ref = models
    with pytest.raises(ValueError, match="one reference completion per rollout"):
        XPOLoss(PreferenceConfig(), ref).compute(policy, GROUPS[:1])


def test_nash_md_is_reinforce_towards_winning_with_a_reinforce_kl(models):
    policy, ref = models
    beta = 0.1
    out = NashMDLoss(PreferenceConfig(beta=beta), ref).compute(policy, GROUPS[1:])
    terms = []
    for r in GROUPS[1].rollouts:
        comp = list(r.sample.token_ids)
        pol = torch.stack(direct_logps(policy, [4, 5], comp))
        rf = torch.stack(direct_logps(ref, [4, 5], comp)).detach()
        kl = ((pol.detach() - rf) * pol).sum()
        terms.append(beta * kl - (r.reward - 0.5) * pol.sum())
    expected = torch.stack(terms).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(grads(policy, out.loss), grads(policy, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_nash_md_losses_pure_parts():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    losses, kl = nash_md_losses(logp, ref, mask, torch.tensor([1.0, 0.5]), beta=0.5)
    torch.testing.assert_close(kl, torch.tensor([-0.5, 0.0]))
    # row 0: 0.5 * (0.5 * -1 + -1 * -2) - 0.5 * (-3); row 1: no KL, p = 0.5: nothing
    torch.testing.assert_close(losses.detach(), torch.tensor([0.5 * 1.5 + 1.5, 0.0]))


def test_importance_weights_are_truncated_sequence_ratios(models):
    policy, ref = models
    stale = RolloutGroup("s", Prompt("s", (1, 2)), (Rollout(sample([5], [-9.0]), 1.0),
                                                    Rollout(sample([6], [0.0]), 0.0)))
    out = OnlineDPOLoss(PreferenceConfig(is_correction=True, is_cap=2.0), ref).compute(policy, [stale])
    with torch.no_grad():
        log_ratio = float(seq(policy, [1, 2], [5]) + 9.0 + seq(policy, [1, 2], [6]))
    w = math.exp(min(math.log(2.0), log_ratio))
    assert float(out.metrics["pref/is_weight_mean"]) == pytest.approx(w, rel=1e-5)


def test_a_preference_loss_needs_its_reference(models):
    with pytest.raises(ConfigError, match="ref_model"):
        OnlineDPOLoss(PreferenceConfig(), None)


def test_under_lora_the_reference_is_the_base_with_the_adapter_disabled():
    pytest.importorskip("peft")
    from asyncrl.lora import LoraConfig, LoraReference, apply_lora

    base = _model()
    frozen = copy.deepcopy(base).requires_grad_(False)
    policy = apply_lora(base, LoraConfig(rank=4, alpha=8))
    with torch.no_grad():  # a non-zero adapter: the policy and the base now disagree
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    with_lora = OnlineDPOLoss(PreferenceConfig(), LoraReference()).compute(policy, GROUPS)
    with_copy = OnlineDPOLoss(PreferenceConfig(), frozen).compute(policy, GROUPS)
    assert with_lora.loss.item() == pytest.approx(with_copy.loss.item(), rel=1e-5)
    assert float(with_lora.metrics["pref/kl"]) != 0.0
    grads_lora = torch.autograd.grad(with_lora.loss, [p for p in policy.parameters() if p.requires_grad])
    assert any(g.abs().sum() > 0 for g in grads_lora), "the adapter is what trains"


def test_online_dpo_with_all_pairs_takes_every_two_completions_judged_apart(models):
    policy, ref = models
    beta = 0.3
    out = OnlineDPOLoss(PreferenceConfig(beta=beta, pairs="all"), ref).compute(policy, GROUPS)
    terms = []
    for g in GROUPS:
        p = list(g.prompt.token_ids)
        for a in g.rollouts:
            for b in g.rollouts:
                if a.reward > b.reward:
                    c, r = list(a.sample.token_ids), list(b.sample.token_ids)
                    h = (seq(policy, p, c) - seq(ref, p, c)) - (seq(policy, p, r) - seq(ref, p, r))
                    terms.append(-F.logsigmoid(beta * h))
    assert len(terms) == 6 + 1 and float(out.metrics["pref/pairs"]) == 7
    expected = torch.stack(terms).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(grads(policy, out.loss), grads(policy, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
