"""Off-policy corrections (asyncrl.algorithms.corrections) checked against direct loop computations on random
inputs: masked importance sampling per token and per sequence, M2PO's second-moment mask, their losses and
gradients, and the per-token staleness gauges; then GRPOLoss, whose token staleness comes from version spans."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.algorithms import Correction, GRPOLoss, LossConfig, policy_loss
from asyncrl.algorithms.corrections import (
    STALENESS_BUCKETS,
    m2po_mask,
    masked_weights,
    staleness_metrics,
    token_staleness,
)
from asyncrl.config import ConfigError
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, Trajectory, VersionSpan
from tests.support.algorithms import t

MASK_TOKEN = LossConfig(correction=Correction.MASK, is_level="token", is_cap=2.0)
MASK_SEQ = LossConfig(correction=Correction.MASK, is_level="sequence", is_cap=1.5)
M2PO = LossConfig(correction=Correction.M2PO)


def _random_case(seed: int, b: int = 6, width: int = 9, spread: float = 1.0):
    """Log-probs with grad, behaviour log-probs, advantages and a loss mask with interior zeros (environment
    tokens of multi-turn rollouts) as well as right padding; one row is all padding."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, width, generator=g) * 3).requires_grad_(True)
    behaviour = logp.detach() + spread * torch.randn(b, width, generator=g)
    mask = (torch.rand(b, width, generator=g) > 0.25).float()
    lengths = torch.randint(1, width + 1, (b,), generator=g)
    mask = mask * (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask[-1] = 0.0
    behaviour = torch.where(mask > 0, behaviour, torch.full_like(behaviour, -50.0))  # junk off the mask
    advantages = torch.randn(b, generator=g)
    return logp, behaviour, advantages, mask


def _loss_by_loop(weight: np.ndarray, adv: np.ndarray, mask: np.ndarray) -> float:
    """token_mean of -w * A with r = 1 (the learner's one step per batch): masked tokens stay in the count."""
    total = sum(-weight[i, j] * adv[i] for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j])
    return total / max(1.0, mask.sum())


# ------------------------------------------------------------------------------------ masked importance sampling


@pytest.mark.parametrize("seed", range(4))
def test_token_masking_matches_a_loop(seed: int) -> None:
    logp, behaviour, adv, mask = _random_case(seed)
    loss, m = policy_loss(logp, logp.detach(), behaviour, adv, mask, MASK_TOKEN)
    lr = (logp.detach() - behaviour).double().numpy()
    want = np.zeros_like(lr)
    dropped = 0
    for i, j in zip(*np.nonzero(mask.numpy())):
        rho = math.exp(lr[i, j])
        if 1 / 2.0 <= rho <= 2.0:
            want[i, j] = rho
        else:
            dropped += 1
    assert 0 < dropped < mask.sum()  # the case exercises both sides
    assert loss.item() == pytest.approx(_loss_by_loop(want, adv.numpy(), mask.numpy()), rel=1e-5, abs=1e-6)
    assert m["loss/is_masked_frac"].item() == pytest.approx(dropped / mask.sum().item())
    assert m["loss/is_trunc_frac"].item() == 0.0
    assert m["loss/is_weight_mean"].item() == pytest.approx(want.sum() / mask.sum().item(), rel=1e-5)
    weight, flag = masked_weights(torch.where(mask > 0, logp.detach() - behaviour, 0.0), mask, "token", 2.0)
    np.testing.assert_allclose((weight * mask).numpy(), want, rtol=1e-5, atol=1e-7)
    assert flag.sum().item() == dropped and (flag * (1 - mask)).sum() == 0  # nothing flagged off the mask


@pytest.mark.parametrize("seed", range(4))
def test_sequence_masking_matches_a_loop_over_model_tokens_only(seed: int) -> None:
    logp, behaviour, adv, mask = _random_case(seed, spread=0.6)
    loss, m = policy_loss(logp, logp.detach(), behaviour, adv, mask, MASK_SEQ)
    lr = (logp.detach() - behaviour).double().numpy()
    want = np.zeros_like(lr)
    masked_tokens = 0
    kept_rows = 0
    for i in range(mask.shape[0]):
        cols = [j for j in range(mask.shape[1]) if mask[i, j]]
        if not cols:
            continue
        g = math.exp(sum(lr[i, j] for j in cols) / len(cols))  # geometric mean over the model tokens
        if 1 / 1.5 <= g <= 1.5:
            kept_rows += 1
            for j in cols:
                want[i, j] = g
        else:
            masked_tokens += len(cols)
    assert kept_rows and masked_tokens  # both kinds of sequence occur
    assert loss.item() == pytest.approx(_loss_by_loop(want, adv.numpy(), mask.numpy()), rel=1e-5, abs=1e-6)
    assert m["loss/is_masked_frac"].item() == pytest.approx(masked_tokens / mask.sum().item())


def test_environment_tokens_never_enter_a_sequence_ratio() -> None:
    # One sequence of model tokens [a, b] with environment tokens between them, against the same two tokens
    # alone: behaviour log-probs at environment positions are junk, and the geometric mean must not see them.
    logp = t([[-1.0, -2.0, -3.0, -1.5]])
    behaviour = t([[-1.2, 40.0, -90.0, -1.1]])
    with_env, _ = policy_loss(logp, logp, behaviour, t([1.0]), t([[1, 0, 0, 1]]), MASK_SEQ)
    alone, _ = policy_loss(t([[-1.0, -1.5]]), t([[-1.0, -1.5]]), t([[-1.2, -1.1]]), t([1.0]), t([[1, 1]]), MASK_SEQ)
    g = math.exp(((-1.0 + 1.2) + (-1.5 + 1.1)) / 2)  # inside [1/1.5, 1.5]: kept
    assert alone.item() == pytest.approx(-g, rel=1e-6)
    assert with_env.item() == pytest.approx(alone.item(), rel=1e-6)


def test_c_equal_one_keeps_only_exact_ratios() -> None:
    logp = t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    behaviour = t([[-1.0, -2.1, -0.5], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = t([1.0, -1.0])
    token = LossConfig(correction=Correction.MASK, is_cap=1.0)
    loss, m = policy_loss(logp, logp, behaviour, adv, mask, token)
    assert m["loss/is_masked_frac"].item() == pytest.approx(1 / 5)  # only the token with ratio e^0.1
    assert loss.item() == pytest.approx((-1 - 1 + 1 + 1) / 5)
    seq = LossConfig(correction=Correction.MASK, is_level="sequence", is_cap=1.0)
    loss, m = policy_loss(logp, logp, behaviour, adv, mask, seq)
    assert m["loss/is_masked_frac"].item() == pytest.approx(3 / 5)  # the whole first sequence
    assert loss.item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("cfg", [MASK_TOKEN, MASK_SEQ, LossConfig(correction=Correction.M2PO, m2_threshold=0.0)])
def test_everything_masked_gives_zero_loss_and_zero_gradient(cfg: LossConfig) -> None:
    logp = t([[-1.0, -2.0], [-3.0, -1.0]], grad=True)
    behaviour = logp.detach() - t([[3.0, 3.0], [3.0, 0.0]]) * t([[1, 1], [-1, 1]])  # |log rho| = 3, or 0 in padding
    mask = t([[1, 1], [1, 0]])
    adv = t([1.0, -1.0])  # rho > 1 with A > 0 and rho < 1 with A < 0: every token is an M2PO candidate
    loss, m = policy_loss(logp, logp.detach(), behaviour, adv, mask, cfg, staleness=t([[0, 0], [5, 0]]))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().max().item() == 0.0
    assert m["loss/is_masked_frac"].item() == 1.0 and m["loss/is_weight_mean"].item() == 0.0
    assert m["loss/is_masked_frac_s0"].item() == 1.0 and m["loss/is_masked_frac_s3plus"].item() == 1.0
    assert all(math.isfinite(float(v)) for v in m.values())


def test_masked_tokens_get_exactly_zero_gradient_and_kept_ones_the_weighted_one() -> None:
    logp, behaviour, adv, mask = _random_case(13)
    for cfg in (MASK_TOKEN, MASK_SEQ, M2PO):
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach(), behaviour, adv, mask, cfg)
        loss.backward()
        lr = torch.where(mask > 0, logp.detach() - behaviour, 0.0)
        if cfg.correction == Correction.M2PO:
            dropped = m2po_mask(lr, mask, adv, cfg.m2_threshold)
            weight = torch.where(dropped > 0, 0.0, lr.exp())
        else:
            weight, dropped = masked_weights(lr, mask, cfg.is_level, cfg.is_cap)
        assert 0 < dropped.sum() < mask.sum()
        assert (logp.grad[dropped > 0] == 0).all()
        # d/dlogp of -w * r * A / N at r = 1 is -w A / N on every kept model token, 0 off the mask
        want = -(weight * adv[:, None]) * mask * (1 - dropped) / mask.sum()
        torch.testing.assert_close(logp.grad, want, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------- M2PO


def _m2po_by_greedy(lr: np.ndarray, mask: np.ndarray, adv: np.ndarray, tau: float, trust_region: bool) -> np.ndarray:
    """The paper's Algorithm 1, one token at a time: drop the largest squared log-ratio while the mean over the
    remaining candidates is above tau."""
    candidates = {(i, j) for i, j in zip(*np.nonzero(mask)) if adv[i] != 0 and (
                  not trust_region or (adv[i] > 0 and lr[i, j] > 0) or (adv[i] < 0 and lr[i, j] < 0))}
    dropped = np.zeros_like(mask)
    while candidates and np.mean([lr[c] ** 2 for c in candidates]) > tau:
        worst = max(candidates, key=lambda c: lr[c] ** 2)
        candidates.remove(worst)
        dropped[worst] = 1.0
    return dropped


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("trust_region", [True, False])
@pytest.mark.parametrize("tau", [0.04, 0.3])
def test_m2po_mask_matches_the_greedy_rule(seed: int, trust_region: bool, tau: float) -> None:
    _, behaviour, adv, mask = _random_case(seed, b=8, width=12, spread=0.5)
    adv[seed % 8] = 0.0  # an inert rollout: never a candidate, so skipping inert groups changes nothing
    logp = -3 * torch.rand(8, 12, generator=torch.Generator().manual_seed(100 + seed))
    lr = torch.where(mask > 0, logp - behaviour, 0.0)
    got = m2po_mask(lr, mask, adv, tau, trust_region)
    want = _m2po_by_greedy(lr.double().numpy(), mask.numpy(), adv.numpy(), tau, trust_region)
    assert want.sum() > 0
    np.testing.assert_array_equal(got.numpy(), want)


def test_m2po_leaves_the_remaining_second_moment_at_most_tau_and_drops_no_more_than_needed() -> None:
    _, behaviour, adv, mask = _random_case(3, b=16, width=20, spread=0.4)
    lr = torch.where(mask > 0, torch.zeros_like(behaviour) - behaviour - 1.5, 0.0)
    dropped = m2po_mask(lr, mask, adv, 0.04, trust_region=False)
    kept = (mask > 0) & (dropped == 0)
    assert (lr[kept] ** 2).mean().item() <= 0.04
    smallest_dropped = (lr[dropped > 0] ** 2).min()
    with_one_back = torch.cat([lr[kept] ** 2, smallest_dropped[None]])
    assert with_one_back.mean().item() > 0.04  # keeping one more would break the bound


def test_m2po_with_a_huge_threshold_is_plain_policy_gradient() -> None:
    logp, behaviour, adv, mask = _random_case(5)
    huge = LossConfig(correction=Correction.M2PO, m2_threshold=1e9)
    # On-policy (behaviour = current): exactly REINFORCE with a group baseline, -A * grad logp / N.
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, huge)
    loss.backward()
    assert m["loss/is_masked_frac"].item() == 0.0 and m["loss/clip_frac"].item() == 0.0
    torch.testing.assert_close(logp.grad, -(adv[:, None] * mask) / mask.sum())
    # Off-policy: the untruncated importance-weighted gradient, whatever the ratio (no truncation, no clip).
    logp.grad = None
    off, m = policy_loss(logp, logp.detach(), behaviour, adv, mask, huge)
    off.backward()
    rho = torch.where(mask > 0, logp.detach() - behaviour, 0.0).exp()
    torch.testing.assert_close(logp.grad, -(rho * adv[:, None] * mask) / mask.sum(), rtol=1e-5, atol=1e-6)


def test_m2po_does_not_clip_against_the_proximal_policy() -> None:
    # current/proximal ratio 1.5 with A > 0: the clipped rule would stop the gradient at 1.28; M2PO keeps it
    logp = t([[math.log(1.5)]], grad=True)
    zeros = t([[0.0]])
    loss, m = policy_loss(logp, zeros, zeros - 0.1, t([1.0]), t([[1.0]]), LossConfig(correction="m2po", m2_threshold=1))
    loss.backward()
    # term = -(pi_prox / pi_behaviour) * r * A = -e^0.1 * 1.5; m2 uses the current policy: (log 1.5 + 0.1)^2 < 1
    assert loss.item() == pytest.approx(-math.exp(0.1) * 1.5, rel=1e-6)
    assert logp.grad.item() == pytest.approx(-math.exp(0.1) * 1.5, rel=1e-6)
    assert m["loss/clip_frac"].item() == 0.0 and m["loss/is_masked_frac"].item() == 0.0


# ------------------------------------------------------------------------------------------------ staleness gauges


def test_staleness_gauges_match_a_loop() -> None:
    g = torch.Generator().manual_seed(7)
    staleness = torch.randint(0, 6, (10, 15), generator=g).float()
    mask = (torch.rand(10, 15, generator=g) > 0.3).float()
    hit = (torch.rand(10, 15, generator=g) > 0.6).float()
    got = staleness_metrics(staleness, mask, hit, "is_masked_frac")
    s, mk, h = staleness.numpy(), mask.numpy() > 0, hit.numpy() > 0
    assert got["loss/staleness_mean"].item() == pytest.approx(s[mk].mean(), rel=1e-6)
    assert got["loss/staleness_max"].item() == s[mk].max()
    for k, bucket in enumerate(STALENESS_BUCKETS):
        inside = mk & ((s >= k) if bucket == "s3plus" else (s == k))
        assert got[f"loss/token_frac_{bucket}"].item() == pytest.approx(inside.sum() / mk.sum(), rel=1e-6)
        assert got[f"loss/is_masked_frac_{bucket}"].item() == pytest.approx((h & inside).sum() / inside.sum(), rel=1e-6)


def test_the_mismatch_at_equal_versions_reads_apart_from_staleness() -> None:
    # Fresh tokens (s0) differ from the behaviour by a precision-sized log-ratio, stale ones (s2) by a large one:
    # the mismatch gauges see only the first, the s2 bucket only the second.
    old = t([[0, 0, 0, 0]])
    behaviour = t([[-0.01, 0.01, -2.0, -2.0]])
    staleness = t([[0, 0, 2, 2]])
    _, m = policy_loss(old.clone(), old, behaviour, t([1]), t([[1, 1, 1, 1]]), LossConfig(is_cap=2.0),
                       staleness=staleness)
    fresh = (math.exp(0.01) - 0.01 - 1 + math.exp(-0.01) + 0.01 - 1) / 2
    assert m["loss/mismatch_kl"].item() == pytest.approx(fresh, rel=1e-3)  # float32
    assert m["loss/approx_kl_behaviour_s2"].item() == pytest.approx(math.exp(2.0) - 2.0 - 1, rel=1e-5)
    assert m["loss/mismatch_cut_frac"].item() == 0.0 and m["loss/is_trunc_frac_s2"].item() == 1.0
    assert m["loss/approx_kl_behaviour_s1"].item() == 0.0  # an empty bucket


def test_truncation_reports_its_capped_fraction_by_bucket_and_keeps_the_old_numbers() -> None:
    # the old rule's case (tests/algorithms/test_losses.py): weights e (capped at 2), e^0.5, 1; and 1
    old = t([[0, 0, 0], [0, 0, 0]])
    behaviour = t([[-1, -0.5, 0], [0, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, m = policy_loss(old.clone(), old, behaviour, t([1, 1]), mask, LossConfig(),
                          staleness=t([[2, 1, 0], [0, 0, 0]]))
    assert loss.item() == pytest.approx(-1.412180, abs=1e-5) and m["loss/is_trunc_frac"].item() == 0.25
    assert m["loss/is_trunc_frac_s2"].item() == 1.0 and m["loss/is_trunc_frac_s0"].item() == 0.0
    assert m["loss/token_frac_s0"].item() == 0.5 and m["loss/is_masked_frac"].item() == 0.0
    assert m["loss/m2_behaviour"].item() == pytest.approx((1 + 0.25) / 4)
    assert "loss/is_masked_frac_s0" not in m


def _sample(n: int, spans: tuple[VersionSpan, ...], mask: tuple[int, ...] | None = None) -> Sample:
    if mask is None:
        return Sample(tuple(range(5, 5 + n)), (-1.0,) * n, FinishReason.STOP, spans)
    return Trajectory(tuple(range(5, 5 + n)), tuple(-1.0 if k else 0.0 for k in mask), FinishReason.STOP, spans,
                      loss_mask=mask)


def test_token_staleness_comes_from_the_version_spans() -> None:
    # a keep-mode sample that saw versions 3 then 5; a trajectory whose environment tokens (2, 3) have no span
    plain = _sample(4, (VersionSpan(3, 0, 2), VersionSpan(5, 2, 4)))
    traj = _sample(5, (VersionSpan(4, 0, 2), VersionSpan(6, 4, 5)), mask=(1, 1, 0, 0, 1))
    rollouts = [Rollout(plain, 1.0), Rollout(traj, 0.0)]
    np.testing.assert_array_equal(token_staleness(rollouts, 6, policy_version=7),
                                  [[4, 4, 2, 2, 0, 0], [3, 3, 0, 0, 1, 0]])
    np.testing.assert_array_equal(token_staleness(rollouts, 5), [[3, 3, 1, 1, 0], [2, 2, 0, 0, 0]])  # newest: 6
    with pytest.raises(ValueError, match="older than a token's version 6"):
        token_staleness(rollouts, 6, policy_version=5)


class _TinyLM(torch.nn.Module):
    """Causal logits from token and position embeddings (cumulative sum: each position sees what came before)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = torch.nn.Embedding(40, 8), torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 40)

    def forward(self, input_ids, attention_mask=None, position_ids=None):  # type: ignore[no-untyped-def]
        h = torch.cumsum(self.tok(input_ids) + self.pos(position_ids), dim=1)
        return type("Out", (), {"logits": self.head(torch.tanh(h))})()


def test_grpo_loss_reports_where_the_mask_bites_by_staleness() -> None:
    model = _TinyLM()
    fresh = _sample(3, (VersionSpan(9, 0, 3),))
    stale = _sample(3, (VersionSpan(6, 0, 3),))  # behaviour log-prob -1.0: far from the model's own
    group = RolloutGroup("g", Prompt("p", (1, 2)), (Rollout(fresh, 1.0), Rollout(stale, 0.0)))
    loss = GRPOLoss(LossConfig(correction=Correction.MASK, is_cap=1.0 + 1e-6))
    out = loss.compute(model, [group], policy_version=10)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["loss/staleness_mean"] == pytest.approx(2.5) and m["loss/staleness_max"] == 4.0
    assert m["loss/token_frac_s1"] == 0.5 and m["loss/token_frac_s3plus"] == 0.5
    assert m["loss/is_masked_frac_s1"] == m["loss/is_masked_frac_s3plus"] == 1.0 == m["loss/is_masked_frac"]
    assert out.loss.item() == 0.0 and out.num_tokens == 6
    default = loss.compute(model, [group]).metrics  # measured from the newest version present, 9
    assert float(default["loss/staleness_max"]) == 3.0 and float(default["loss/token_frac_s0"]) == 0.5


# ------------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("kwargs, field", [
    ({"correction": "clip"}, "LossConfig.correction"),
    ({"correction": "mask", "is_level": "none"}, "LossConfig.is_level"),
    ({"correction": "mask", "is_cap": 0.5}, "LossConfig.is_cap"),
    ({"m2_threshold": -0.1}, "LossConfig.m2_threshold"),
    ({"m2_threshold": math.inf}, "LossConfig.m2_threshold"),
    ({"m2_trust_region": 1}, "LossConfig.m2_trust_region"),
])
def test_correction_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        LossConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_the_default_is_still_truncation_and_strings_name_the_modes() -> None:
    assert LossConfig().correction == Correction.TRUNCATE == "truncate"
    assert LossConfig(correction="m2po").correction == Correction.M2PO  # type: ignore[arg-type]
