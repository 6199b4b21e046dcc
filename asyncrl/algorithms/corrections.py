"""Off-policy corrections: what the policy loss does with a token whose behaviour ratio is far from 1, and the
per-token staleness telemetry that shows where that happens.

With ``rho = pi_proximal / pi_behaviour`` per model token (the learner takes one step per batch, so the
proximal policy is the current one, detached) and ``c = LossConfig.is_cap``:

- ``truncate`` (``losses.importance_weights``): ``w = min(rho, c)``, per token or per sequence (product).
- ``mask``, token level: ``w = rho`` where ``1/c <= rho <= c``, else 0. Sequence level: the sequence's ratio is
  the geometric mean ``g = exp(mean_t log rho_t)`` over its model tokens; ``w = g`` on every token when
  ``1/c <= g <= c``, else the whole sequence gets 0. The geometric mean, not the product: the log of a product
  grows with length (its spread like sqrt(length)), so a fixed ``c`` would mask long sequences far more often
  than short ones, the length bias asynchrony already suffers from; per token, ``g`` means the same at any
  length and, like the token weight, stays within ``[1/c, c]``.
- ``m2po`` (M2PO, arXiv 2510.01161): with ``m2 = (log pi_current - log pi_behaviour)^2`` per token, mask the
  tokens with the largest ``m2`` until the mean ``m2`` of the rest is ``<= tau`` (``m2_threshold``); the rest get
  the plain importance-weighted gradient ``rho * r * A`` (no clipping). As in the paper, only tokens where the
  update pushes the ratio further from 1 (``A > 0, rho > 1`` or ``A < 0, rho < 1``) are candidates and enter the
  mean, unless ``m2_trust_region=False`` (then every token with a nonzero advantage). Tokens of advantage 0
  never are: they move nothing, and leaving them out makes skipping inert groups exact. The loss sees one
  micro-batch, so each micro-batch meets the bound; the step, a token-weighted mean of them, meets it too.

A masked token has weight 0 but stays in the normaliser (``losses.normalise``), as a clipped token does: the
step stays the same whatever the micro-batching (the learner weights micro-batches by model tokens), a batch
with everything masked has loss exactly 0, and masking shrinks the step rather than inflating the survivors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from asyncrl.types import Rollout


class Correction(str, enum.Enum):
    """What the loss does with tokens whose proximal/behaviour ratio is far from 1 (module docstring)."""

    TRUNCATE = "truncate"  # cap the weight at is_cap (the weight keeps its gradient-free role)
    MASK = "mask"  # drop the term when the ratio (token's, or sequence's geometric mean) leaves [1/c, c]
    M2PO = "m2po"  # drop the largest squared log-ratios until their mean is <= m2_threshold; no clipping


STALENESS_BUCKETS = ("s0", "s1", "s2", "s3plus")  # tokens 0, 1, 2 and 3+ versions behind the learner


def masked_weights(log_ratio: Tensor, mask: Tensor, level: str, cap: float) -> tuple[Tensor, Tensor]:
    """Masked importance weights ``[B, T]`` and a float flag of the masked model tokens, both detached.

    ``log_ratio`` is ``log(proximal / behaviour)``, 0 wherever ``mask`` is 0 (padding, environment tokens), so
    those never enter a sequence's ratio. ``level`` is ``"token"`` or ``"sequence"`` (geometric mean)."""
    log_ratio = log_ratio.detach()
    if level == "sequence":
        tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens).expand_as(mask)
    out = (log_ratio.abs() > math.log(cap)) & (mask > 0)  # |log rho| > log c  <=>  rho outside [1/c, c]
    return torch.where(out, 0.0, log_ratio.exp()), out.to(mask.dtype)


def m2po_mask(log_ratio: Tensor, mask: Tensor, advantages: Tensor, tau: float,
              trust_region: bool = True) -> Tensor:
    """Float flag ``[B, T]`` of the tokens M2PO masks: the fewest largest ``log_ratio**2`` whose removal brings
    the mean over the remaining candidates to ``<= tau`` (``advantages`` ``[B]``; module docstring).

    One sort, no host round trip: the mean of what remains after dropping the ``k`` largest never rises with
    ``k`` (the largest is never below the mean), so the number to drop is the count of ``k`` whose mean is over
    ``tau``. Sums are taken in float64, so the count matches the one-at-a-time greedy rule."""
    log_ratio = log_ratio.detach()
    a = advantages.detach()[:, None]
    if trust_region:
        candidate = (mask > 0) & (((a > 0) & (log_ratio > 0)) | ((a < 0) & (log_ratio < 0)))
    else:
        candidate = (mask > 0) & (a != 0)
    m2 = torch.where(candidate, log_ratio.double().square(), -1.0).flatten()  # non-candidates sort last
    ranked, order = torch.sort(m2, descending=True)
    ranked = ranked.clamp(min=0)
    left = torch.flip(torch.cumsum(torch.flip(ranked, [0]), 0), [0])  # left[k]: sum of ranked[k:]
    k = torch.arange(m2.numel(), device=m2.device)
    n = candidate.sum()
    over = (k < n) & (left > tau * (n - k).double())  # mean of the n - k candidates left after dropping k is over tau
    drop = k < over.sum()
    return torch.zeros_like(drop).scatter(0, order, drop).view_as(mask).to(mask.dtype)


def token_staleness(rollouts: Sequence[Rollout], width: int, policy_version: int | None = None) -> np.ndarray:
    """``[B, width]`` float32 staleness of every completion token: ``policy_version`` minus the version that
    sampled it (``Sample.version_spans``), 0 where no span covers a position (padding, environment tokens).

    Without ``policy_version`` the newest version among these rollouts stands in: a lower bound on the
    learner's version, exact whenever a token of the current weights is among them."""
    newest = max((s.version for r in rollouts for s in r.sample.version_spans), default=0)
    reference = newest if policy_version is None else policy_version
    if reference < newest:
        raise ValueError(f"policy_version {policy_version} is older than a token's version {newest}")
    out = np.zeros((len(rollouts), width), dtype=np.float32)
    for i, r in enumerate(rollouts):
        for span in r.sample.version_spans:
            out[i, span.start:span.end] = reference - span.version
    return out


def staleness_metrics(staleness: Tensor, mask: Tensor, hit: Tensor, name: str,
                      kl: Tensor | None = None) -> dict[str, Tensor]:
    """Detached 0-dim gauges over model tokens: ``loss/staleness_mean`` and ``_max``, and per staleness bucket
    the share of tokens in it (``loss/token_frac_<bucket>``), the fraction of its tokens that ``hit`` flags
    (``loss/<name>_<bucket>``: where the correction bites; 0 for an empty bucket) and, given the per-token k3
    ``kl`` against the behaviour policy, its mean there (``loss/approx_kl_behaviour_<bucket>``).

    Bucket ``s0`` holds tokens sampled by the weights the learner holds: their ratio is the train-inference
    mismatch alone (the engine's precision and kernels), not staleness. ``loss/mismatch_kl`` and
    ``loss/mismatch_cut_frac`` name it, so what an FP8 engine costs reads apart from what asynchrony costs."""
    staleness, hit = staleness.detach(), hit.detach()
    total = mask.sum().clamp(min=1)
    out = {"loss/staleness_mean": (staleness * mask).sum() / total, "loss/staleness_max": (staleness * mask).max()}
    last = len(STALENESS_BUCKETS) - 1
    for s, bucket in enumerate(STALENESS_BUCKETS):
        inside = mask * ((staleness >= s) if s == last else (staleness == s)).to(mask.dtype)
        count = inside.sum()
        out[f"loss/token_frac_{bucket}"] = count / total
        out[f"loss/{name}_{bucket}"] = (hit * inside).sum() / count.clamp(min=1)
        if kl is not None:
            out[f"loss/approx_kl_behaviour_{bucket}"] = (kl.detach() * inside).sum() / count.clamp(min=1)
    out["loss/mismatch_cut_frac"] = out[f"loss/{name}_{STALENESS_BUCKETS[0]}"]
    if kl is not None:
        out["loss/mismatch_kl"] = out[f"loss/approx_kl_behaviour_{STALENESS_BUCKETS[0]}"]
    return out
