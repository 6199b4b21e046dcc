"""Group-relative advantages: each rollout's reward measured against the other rollouts of its prompt."""

from __future__ import annotations

import enum

import torch
from torch import Tensor


class Estimator(str, enum.Enum):
    """The baseline a rollout's reward is measured against."""

    GRPO = "grpo"  # the group mean
    RLOO = "rloo"  # the mean of the other rollouts of the group


ESTIMATORS: tuple[str, ...] = tuple(e.value for e in Estimator)


def group_advantages(
    rewards: Tensor, estimator: Estimator | str = Estimator.GRPO, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantages for ``G`` groups of ``n`` rollouts; ``rewards`` and the result are ``[G, n]``.

    - ``"grpo"``: ``r_i - mean(r)``, the group mean as baseline.
    - ``"rloo"``: ``r_i - mean_{j != i}(r_j)``; leaving the rollout out of its own baseline keeps the
      estimate unbiased. It equals ``n / (n - 1) * (r_i - mean(r))``.

    With ``scale_by_std`` either one is divided by ``std(r) + eps``, using the population std
    (``unbiased=False``): it is defined for every group size and puts a half-right binary group at exactly
    +-1. ``scale_by_std=False`` with ``"grpo"`` is Dr. GRPO, which drops the std to avoid up-weighting
    near-uniform groups. Groups whose rewards are all equal get 0. A group of size 1 has no baseline to
    compare against, so its advantage is 0 (it contributes no policy gradient).

    Raises ``ValueError`` for a tensor that is not 2-D, an empty group, or a NaN/inf reward.
    """
    _check_rewards(rewards, estimator)
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    n = rewards.shape[1]
    if n == 1:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = centred * (n / (n - 1)) if estimator == "rloo" else centred
    if scale_by_std:
        advantages = advantages / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return advantages


def _check_rewards(rewards: Tensor, estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] == 0:
        raise ValueError(f"groups must hold at least one reward, got shape {tuple(rewards.shape)}")
    finite = torch.isfinite(rewards).all(dim=1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"rewards of group(s) {bad} are NaN or infinite")
