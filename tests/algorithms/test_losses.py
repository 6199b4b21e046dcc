"""Advantages and the policy loss, checked against values worked out by hand (completion scoring and GRPOLoss on a
tiny model are in test_losses_scoring.py)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import LossConfig, group_advantages, k3, policy_loss
from asyncrl.config import ConfigError
from tests.support.algorithms import t

# ------------------------------------------------------------------------------------------------ advantages


def test_grpo_population_std() -> None:
    # [1,0,0,1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = +-1
    adv = group_advantages(t([[1, 0, 0, 1]]))
    torch.testing.assert_close(adv, t([[1, -1, -1, 1]]), atol=1e-5, rtol=0)


def test_dr_grpo_is_mean_centred_only() -> None:
    # no std: [1,0,0,1] - 0.5 = +-0.5; second group [2,4] - 3 = [-1, 1]
    adv = group_advantages(t([[1, 0, 0, 1], [2, 4, 3, 3]]), scale_by_std=False)
    torch.testing.assert_close(adv, t([[0.5, -0.5, -0.5, 0.5], [-1, 1, 0, 0]]))


def test_rloo_leave_one_out() -> None:
    # [1,0,0]: baselines mean(0,0)=0, mean(1,0)=0.5, mean(1,0)=0.5 -> [1, -0.5, -0.5]
    adv = group_advantages(t([[1, 0, 0]]), estimator="rloo", scale_by_std=False)
    torch.testing.assert_close(adv, t([[1, -0.5, -0.5]]))
    # scaled: population std of [1,0,0] = sqrt(2/9) = 0.471405 -> [2.121320, -1.060660, -1.060660]
    scaled = group_advantages(t([[1, 0, 0]]), estimator="rloo")
    torch.testing.assert_close(scaled, t([[2.121320, -1.060660, -1.060660]]), atol=1e-5, rtol=0)


def test_uniform_and_singleton_groups_get_zero() -> None:
    assert group_advantages(t([[3, 3, 3]])).abs().max() == 0
    for estimator in ("grpo", "rloo"):
        assert group_advantages(t([[5.0], [-2.0]]), estimator=estimator).abs().max() == 0


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1.0, 0.0]), "shape"),
    (torch.zeros(2, 0), "at least one"),
    (torch.tensor([[1.0, math.nan], [0.0, 1.0]]), r"group\(s\) \[0\]"),
    (torch.tensor([[1.0, 0.0], [math.inf, 1.0]]), r"group\(s\) \[1\]"),
])
def test_advantages_reject_bad_input(bad: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(bad)


# --------------------------------------------------------------------------------------------- policy_loss

NO_IS = LossConfig(is_level="none")


@pytest.mark.parametrize("ratio, adv, loss, grad, clip", [
    (1.5, 1.0, -1.28, 0.0, 1.0),  # A>0, r above 1+0.28: surrogate = 1.28 A, constant -> no gradient
    (1.1, 1.0, -1.1, -1.1, 0.0),  # A>0 inside the range: loss = -r A, d/dlogp = -r A
    (0.5, 1.0, -0.5, -0.5, 0.0),  # A>0, r below 1-0.2: min picks r A (pessimistic), gradient kept
    (0.5, -1.0, 0.8, 0.0, 1.0),  # A<0, r below 0.8: surrogate = 0.8 A, constant -> no gradient
    (1.5, -1.0, 1.5, 1.5, 0.0),  # A<0, r above 1.28: min picks r A = -1.5, gradient kept
])
def test_clipping(ratio: float, adv: float, loss: float, grad: float, clip: float) -> None:
    logp = t([[math.log(ratio)]], grad=True)
    zeros = t([[0.0]])  # proximal and behaviour log-probs: r = exp(logp - 0)
    out, metrics = policy_loss(logp, zeros, zeros, t([adv]), t([[1.0]]), NO_IS)
    out.backward()
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
    assert metrics["loss/clip_frac"] == clip


def _is_case(level: str) -> tuple[torch.Tensor, dict[str, float]]:
    # seq 0: 3 tokens with log(old/behaviour) = [1, 0.5, 0]; seq 1: 1 token with 0. A = 1, r = 1.
    old = t([[0, 0, 0], [0, 0, 0]])
    behaviour = t([[-1, -0.5, 0], [0, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    return policy_loss(old.clone(), old, behaviour, t([1, 1]), mask, LossConfig(is_level=level, is_cap=2.0))


def test_token_level_is_truncation() -> None:
    # token weights: min(e, 2) = 2 (capped), e^0.5 = 1.648721, 1; and 1 -> mean (2+1.648721+1+1)/4 = 1.412180
    loss, m = _is_case("token")
    assert loss.item() == pytest.approx(-1.412180, abs=1e-5)  # -w * r * A averaged over 4 tokens
    assert m["loss/is_weight_mean"] == pytest.approx(1.412180, abs=1e-5)
    assert m["loss/is_trunc_frac"] == pytest.approx(1 / 4)
    # untruncated ratios: (e + e^0.5 + 1 + 1) / 4 = 1.591751; k3: (e-2 + e^0.5-1.5 + 0 + 0) / 4 = 0.216751
    assert m["loss/ratio_behaviour_mean"] == pytest.approx(1.591751, abs=1e-5)
    assert m["loss/approx_kl_behaviour"] == pytest.approx(0.216751, abs=1e-5)


def test_sequence_level_is_truncation() -> None:
    # seq 0: exp(1 + 0.5 + 0) = 4.48 -> capped at 2 on all 3 tokens; seq 1: exp(0) = 1.
    # weight mean over tokens (2*3 + 1) / 4 = 1.75; truncated tokens 3 of 4
    loss, m = _is_case("sequence")
    assert loss.item() == pytest.approx(-1.75, abs=1e-6)
    assert m["loss/is_weight_mean"] == pytest.approx(1.75, abs=1e-6)
    assert m["loss/is_trunc_frac"] == pytest.approx(3 / 4)


def test_no_is_weights() -> None:
    loss, m = _is_case("none")
    assert loss.item() == pytest.approx(-1.0)
    assert m["loss/is_weight_mean"] == 1.0 and m["loss/is_trunc_frac"] == 0.0


def test_is_weight_carries_no_gradient_to_proximal() -> None:
    old = t([[0.3]], grad=True)
    logp = t([[0.3]], grad=True)
    loss, _ = policy_loss(logp, old, t([[0.0]]), t([1.0]), t([[1.0]]), LossConfig(is_cap=10.0))
    loss.backward()
    assert old.grad is None or old.grad.abs().max() == 0
    # d/dlogp of -w r A at r = 1 is -w = -e^0.3
    assert logp.grad.item() == pytest.approx(-math.exp(0.3), abs=1e-6)


def test_k3_values_and_kl_penalty() -> None:
    # x = ref - logp: x = 0.5 -> e^0.5 - 1.5 = 0.148721; x = -1 -> e^-1 + 1 - 1 = 0.367879
    assert k3(torch.tensor(0.5)).item() == pytest.approx(0.148721, abs=1e-6)
    logp = t([[-1.0, -1.0]], grad=True)
    ref = t([[-0.5, -2.0]])
    cfg = LossConfig(is_level="none", kl_coef=0.1)
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), t([0.0]), t([[1, 1]]), cfg, ref_logp=ref)
    assert m["loss/kl"] == pytest.approx((0.148721 + 0.367879) / 2, abs=1e-6)  # 0.258300
    assert loss.item() == pytest.approx(0.1 * 0.258300, abs=1e-6)  # A = 0 -> policy term 0
    loss.backward()
    # d k3 / d logp = 1 - e^x: [1 - 1.648721, 1 - 0.367879] * 0.1 / 2 tokens
    torch.testing.assert_close(logp.grad, t([[-0.0324361, 0.0316060]]), atol=1e-6, rtol=0)


def test_entropy_bonus_lowers_loss_and_pushes_entropy_up() -> None:
    entropy = t([[1.0, 2.0]], grad=True)
    zeros = t([[0.0, 0.0]])
    cfg = LossConfig(entropy_coef=0.01)
    loss, m = policy_loss(zeros, zeros, zeros, t([0.0]), t([[1, 1]]), cfg, entropy=entropy)
    assert loss.item() == pytest.approx(-0.015)  # -0.01 * mean(1, 2)
    assert m["loss/entropy"] == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(entropy.grad, t([[-0.005, -0.005]]))  # gradient descent raises entropy


@pytest.mark.parametrize("norm, expected", [
    ("token_mean", -0.25),  # (3 * -1 + 1 * 2) / 4 tokens
    ("seq_mean", 0.5),  # mean(-1 over seq 0, 2 over seq 1)
    ("dr_grpo", -0.125),  # (-3 + 2) / (2 sequences * max_tokens 4)
])
def test_length_norm(norm: str, expected: float) -> None:
    # r = 1, no IS: per-token term = -A; seq 0 has A = 1 on 3 tokens, seq 1 has A = -2 on 1 token
    zeros = t([[0, 0, 0], [0, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    cfg = LossConfig(is_level="none", length_norm=norm)
    loss, _ = policy_loss(zeros, zeros, zeros, t([1, -2]), mask, cfg, max_tokens=4)
    assert loss.item() == pytest.approx(expected)


def test_padding_values_are_ignored() -> None:
    logp = t([[0.1, 55.0]])
    behaviour = t([[0.1, -900.0]])
    loss, m = policy_loss(logp, logp, behaviour, t([1.0]), t([[1, 0]]), LossConfig())
    assert loss.item() == pytest.approx(-1.0) and m["loss/is_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 4}, "LossConfig.max_tokens"),  # comes from SamplingConfig: refused, naming itself
    ({"estimator": "ppo"}, "LossConfig.estimator"),
    ({"clip_low": 1.0}, "LossConfig.clip_low"),
    ({"is_level": "batch"}, "LossConfig.is_level"),
    ({"is_cap": 0.0}, "LossConfig.is_cap"),
    ({"temperature": 0.0}, "LossConfig.temperature"),
    ({"kl_coef": -1.0}, "LossConfig.kl_coef"),
])
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        LossConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_shape_errors() -> None:
    x = t([[0.0, 0.0]])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, t([1.0, 2.0]), x, LossConfig())
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, x, t([1.0]), x, LossConfig(kl_coef=0.1))
