"""Online preference losses: Online DPO (sigmoid or IPO), XPO, and Nash-MD.

Each implements ``asyncrl.algorithms.losses.Loss`` over the groups a ``JudgedGroups`` produced, whose rollout
rewards are preference scores in [0, 1]:

- **Online DPO** pairs the group's best completion (chosen) with its worst (rejected); with
  ``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`` (sequence log-probs), the sigmoid loss is
  ``-log sigmoid(beta h)`` and IPO's is ``(h - 1 / (2 beta))^2``.
- **XPO** judges each completion against one sampled by the reference (``RolloutGroup.companions["opponents"]``):
  the winner is chosen, the loser rejected, under the same DPO loss, plus the exploration term ``alpha log pi(y_ref)``,
  which lowers the policy's probability of the reference's own completions.
- **Nash-MD** judges each completion ``y`` against one sampled from the geometric mixture of policy and
  reference (``asyncrl.preference.mixture``), with ``p`` the probability that ``y`` won:
  ``beta * sum_t sg(log pi - log ref) log pi - (p - 1/2) log pi(y)``, a REINFORCE step towards winning, with
  0.5 as its baseline, and towards the reference through the KL's REINFORCE gradient.

Staleness: behaviour log-probs and versions travel as for GRPO. ``PreferenceConfig.is_correction`` weights each
pair (or completion) by its truncated sequence importance weight, proximal over behaviour; bench/cpu/preference.py
measures whether stale pairs need it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from asyncrl.algorithms.logprobs import PLAIN, ScoringOptions, completion_logprobs
from asyncrl.algorithms.losses import Loss, LossOutput, masked_mean
from asyncrl.algorithms.reference import Reference, reference_logprobs
from asyncrl.config import ConfigError, SamplingConfig
from asyncrl.config_base import Flag, NonNegativeFloat, PositiveFloat, config
from asyncrl.preference.groups import OPPONENTS
from asyncrl.types import RolloutGroup, Sample

__all__ = ["NashMDLoss", "OnlineDPOLoss", "PairSelection", "PreferenceConfig", "PreferenceLossType", "XPOLoss",
           "dpo_losses", "nash_md_losses", "pair_weights"]


class PairSelection(str, enum.Enum):
    BEST_WORST = "best_worst"  # a group's best completion against its worst: one pair per group
    ALL = "all"  # every two completions the judge scored differently, the better one chosen


class PreferenceLossType(str, enum.Enum):
    SIGMOID = "sigmoid"  # DPO's logistic loss
    IPO = "ipo"  # IPO's squared loss towards a margin of 1 / (2 beta)


@config
class PreferenceConfig:
    """The preference losses' settings (TRL's defaults where it has them)."""

    beta: Annotated[PositiveFloat, Field(description=(
        "strength of the pull towards the reference: DPO/IPO's beta, Nash-MD's KL weight"))] = 0.1
    loss_type: Annotated[PreferenceLossType, Field(description="'sigmoid' (DPO) or 'ipo'")] = (
        PreferenceLossType.SIGMOID)
    alpha: Annotated[NonNegativeFloat, Field(description="XPO's exploration weight")] = 1e-5
    pairs: Annotated[PairSelection, Field(description=(
        "Online DPO's pairs within a group: 'best_worst' (one) or 'all' (every two scored differently)"))] = (
        PairSelection.BEST_WORST)
    is_correction: Annotated[Flag, Field(description=(
        "weight each pair (Nash-MD: each completion) by its sequence importance weight, proximal over "
        "behaviour, truncated at is_cap"))] = False
    is_cap: Annotated[PositiveFloat, Field(description="truncation of those weights")] = 2.0


# ---------------------------------------------------------------------------------------------- pure parts


def dpo_losses(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float,
               loss_type: PreferenceLossType | str = PreferenceLossType.SIGMOID) -> tuple[Tensor, Tensor]:
    """Per-pair losses ``[P]`` and the margins ``h`` ``[P]`` from sequence log-probs (policy ``chosen``,
    ``rejected``; reference ``ref_chosen``, ``ref_rejected``)."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if PreferenceLossType(loss_type) is PreferenceLossType.IPO:
        return (h - 1.0 / (2.0 * beta)) ** 2, h
    return -F.logsigmoid(beta * h), h


def nash_md_losses(logp: Tensor, ref_logp: Tensor, mask: Tensor, win_prob: Tensor,
                   beta: float) -> tuple[Tensor, Tensor]:
    """Per-completion Nash-MD losses ``[B]`` and sequence log-ratios to the reference ``[B]`` (detached), from
    token log-probs ``[B, T]`` (policy with grad, reference), the mask, and the probabilities of winning ``[B]``."""
    seq_logp = (logp * mask).sum(-1)
    log_ratio = ((logp - ref_logp) * mask).detach()
    kl_term = (log_ratio * logp * mask).sum(-1)
    return beta * kl_term - (win_prob - 0.5) * seq_logp, log_ratio.sum(-1)


def pair_weights(log_ratios: Tensor, cap: float) -> Tensor:
    """Truncated importance weights ``min(exp(x), cap)`` of sequence log-ratios ``[P]``, detached."""
    return log_ratios.detach().clamp(max=math.log(cap)).exp()


# ------------------------------------------------------------------------------------------ shared scoring


class _Scored:
    """Sequence log-probs of a list of completions under the policy (with grad) and the reference, plus the
    proximal/behaviour sequence log-ratios for importance weights."""

    def __init__(self, loss: _PreferenceLoss, model: torch.nn.Module, prompts: list[tuple[int, ...]],
                 samples: list[Sample], scoring: ScoringOptions) -> None:
        completions = [s.token_ids for s in samples]
        scored = completion_logprobs(model, prompts, completions, temperature=loss.sampling.temperature,
                                     pad_id=loss.pad_id, scoring=scoring)
        self.mask = scored.mask.to(scored.logprobs.dtype)
        self.token_logp = scored.logprobs
        self.ref_token_logp = reference_logprobs(loss.ref_model, model, prompts, completions,
                                                 temperature=loss.sampling.temperature, pad_id=loss.pad_id,
                                                 scoring=scoring)
        self.logp = (self.token_logp * self.mask).sum(-1)
        self.ref_logp = (self.ref_token_logp * self.mask).sum(-1)
        behaviour = torch.zeros_like(self.mask)
        for i, s in enumerate(samples):
            behaviour[i, : len(s.logprobs)] = torch.tensor(s.logprobs, dtype=behaviour.dtype)
        self.behaviour_log_ratio = ((self.token_logp.detach() - behaviour) * self.mask).sum(-1)
        self.num_tokens = int(self.mask.sum())


class _PreferenceLoss(Loss):
    def __init__(self, cfg: PreferenceConfig, ref_model: Reference | None, *, sampling: SamplingConfig | None = None,
                 pad_id: int = 0) -> None:
        if ref_model is None:
            raise ConfigError(f"{type(self).__name__}.ref_model", "a preference loss needs its frozen reference "
                                                                  "(a frozen copy, or LoraReference under LoRA)")
        self.cfg = cfg
        self.ref_model = ref_model
        self.sampling = sampling or SamplingConfig()  # scored at the sampling temperature
        self.pad_id = pad_id

    def _dpo(self, model: torch.nn.Module, samples: list[Sample], prompts: list[tuple[int, ...]],
             pairs: list[tuple[int, int]], scoring: ScoringOptions, decisive: list[bool] | None = None
             ) -> tuple[Tensor, dict[str, Tensor], _Scored]:
        """The DPO/IPO loss of ``pairs`` (indices of chosen and rejected into ``samples``, each scored once) as a
        mean over the ``decisive`` ones (default all), and its metrics."""
        scored = _Scored(self, model, prompts, samples, scoring)
        c = torch.tensor([i for i, _ in pairs], device=scored.logp.device)
        r = torch.tensor([j for _, j in pairs], device=scored.logp.device)
        losses, h = dpo_losses(scored.logp[c], scored.logp[r], scored.ref_logp[c], scored.ref_logp[r],
                               self.cfg.beta, self.cfg.loss_type)
        weights = (pair_weights(scored.behaviour_log_ratio[c] + scored.behaviour_log_ratio[r], self.cfg.is_cap)
                   if self.cfg.is_correction else torch.ones_like(losses))
        is_weight_mean = weights.mean()
        p = len(pairs)
        if decisive is not None:  # a tied pair has no side to prefer: it adds nothing to the DPO term
            weights = weights * torch.tensor(decisive, dtype=weights.dtype, device=weights.device)
        loss = (weights * losses).sum() / max(1, p if decisive is None else sum(decisive))
        beta = self.cfg.beta
        kl = (scored.logp - scored.ref_logp).detach()
        metrics = {"loss/policy": loss.detach(), "pref/margin": (beta * h).detach().mean(),
                   "pref/chosen_reward": (beta * (scored.logp[c] - scored.ref_logp[c])).detach().mean(),
                   "pref/rejected_reward": (beta * (scored.logp[r] - scored.ref_logp[r])).detach().mean(),
                   "pref/accuracy": (h > 0).float().mean(), "pref/kl": kl.mean(),
                   "pref/is_weight_mean": is_weight_mean, "pref/pairs": torch.tensor(float(p)),
                   "pref/decisive_frac": torch.tensor(1.0 if decisive is None else sum(decisive) / max(1, p))}
        return loss, metrics, scored


class OnlineDPOLoss(_PreferenceLoss):
    """Online DPO / IPO on each group's best and worst completion (``JudgedGroups`` without an opponent)."""

    min_group_size = 2  # a pair

    def compute(self, model: torch.nn.Module, groups: Sequence[RolloutGroup], *, scoring: ScoringOptions = PLAIN,
                **_: object) -> LossOutput:
        samples, prompts, pairs = [], [], []
        for g in _non_empty(groups):
            first = len(samples)
            samples.extend(r.sample for r in g.rollouts)
            prompts.extend(g.prompt.token_ids for _ in g.rollouts)
            pairs.extend((first + i, first + j) for i, j in self._pairs(g.rewards))
        loss, metrics, _ = self._dpo(model, samples, prompts, pairs, scoring)
        return LossOutput(loss=loss, metrics={**metrics, "loss/total": loss.detach()},
                          num_tokens=sum(g.num_tokens for g in groups))

    def _pairs(self, scores: tuple[float, ...]) -> list[tuple[int, int]]:
        """(chosen, rejected) within one group: its best and worst, or every pair of unequal scores."""
        if self.cfg.pairs is PairSelection.ALL:
            return [(i, j) for i in range(len(scores)) for j in range(len(scores)) if scores[i] > scores[j]]
        order = sorted(range(len(scores)), key=lambda i: scores[i])
        return [(order[-1], order[0])]

    def inert(self, group: RolloutGroup) -> bool:
        rewards = group.rewards
        return all(r == rewards[0] for r in rewards)  # a tie has no pair (the scorer drops those already)


class XPOLoss(_PreferenceLoss):
    """XPO: DPO between each completion and the reference's (``RolloutGroup.companions["opponents"]``), oriented by the
    judge, plus ``alpha * log pi(y_ref)``. Tied pairs add only the exploration term."""

    min_group_size = 1

    def compute(self, model: torch.nn.Module, groups: Sequence[RolloutGroup], *, scoring: ScoringOptions = PLAIN,
                **_: object) -> LossOutput:
        samples, prompts, pairs, decisive, opponent_at = [], [], [], [], []
        for g in _non_empty(groups):
            opponents = g.companions.get(OPPONENTS, ())
            if len(opponents) != len(g.rollouts):
                raise ValueError(f"group {g.group_id}: XPO needs one reference completion per rollout "
                                 f"(RolloutGroup.companions[{OPPONENTS!r}]), got {len(opponents)} for "
                                 f"{len(g.rollouts)}")
            for r, o in zip(g.rollouts, opponents):
                mine, theirs = len(samples), len(samples) + 1
                samples += [r.sample, o]
                prompts += [g.prompt.token_ids] * 2
                pairs.append((mine, theirs) if r.reward > 0.5 else (theirs, mine))
                decisive.append(r.reward != 0.5)
                opponent_at.append(theirs)
        dpo, metrics, scored = self._dpo(model, samples, prompts, pairs, scoring, decisive)
        opponent_logp = scored.logp[torch.tensor(opponent_at, device=scored.logp.device)]
        exploration = self.cfg.alpha * opponent_logp.mean()
        loss = dpo + exploration
        metrics = {**metrics, "loss/policy": dpo.detach(), "loss/xpo_exploration": exploration.detach(),
                   "loss/total": loss.detach()}
        return LossOutput(loss=loss, metrics=metrics, num_tokens=sum(g.num_tokens for g in groups))


class NashMDLoss(_PreferenceLoss):
    """Nash-MD on each completion and its probability of beating the mixture's (the rollout's reward)."""

    min_group_size = 1

    def compute(self, model: torch.nn.Module, groups: Sequence[RolloutGroup], *, scoring: ScoringOptions = PLAIN,
                **_: object) -> LossOutput:
        rollouts = [r for g in _non_empty(groups) for r in g.rollouts]
        prompts = [g.prompt.token_ids for g in groups for _ in g.rollouts]
        scored = _Scored(self, model, prompts, [r.sample for r in rollouts], scoring)
        win = torch.tensor([r.reward for r in rollouts], dtype=scored.logp.dtype, device=scored.logp.device)
        losses, kl = nash_md_losses(scored.token_logp, scored.ref_token_logp, scored.mask, win, self.cfg.beta)
        weights = (pair_weights(scored.behaviour_log_ratio, self.cfg.is_cap) if self.cfg.is_correction
                   else torch.ones_like(losses))
        loss = (weights * losses).mean()
        metrics = {"loss/policy": loss.detach(), "loss/total": loss.detach(), "pref/kl": kl.mean(),
                   "pref/win_prob": win.mean(), "pref/is_weight_mean": weights.mean(),
                   "pref/token_kl": masked_mean(scored.token_logp - scored.ref_token_logp, scored.mask)}
        return LossOutput(loss=loss, metrics=metrics, num_tokens=sum(g.num_tokens for g in groups))


def _non_empty(groups: Sequence[RolloutGroup]) -> Sequence[RolloutGroup]:
    if not groups:
        raise ValueError("compute needs at least one group")
    for g in groups:
        if not g.rollouts:
            raise ValueError(f"group {g.group_id} has no rollouts")
    return groups
