"""The policy loss: a clipped surrogate on a proximal policy, corrected for stale behaviour samples.

Three policies meet here. The *behaviour* policy sampled the tokens (an engine holding weights that may be
several versions old; its log-probs travel in ``Sample.logprobs``). The *proximal* policy is the
anchor of the trust region: the learner's weights at the start of the optimiser step, detached. The
*current* policy is the one being differentiated. Following AReaL's decoupled objective, the ratio that is
clipped compares current with proximal, so the trust region is measured from weights the learner actually
had, however stale the samples; the gap between proximal and behaviour is corrected separately by a
truncated importance weight that carries no gradient. ``LossConfig.correction`` can mask such terms instead
(per token or per sequence), or bound their second moment (M2PO): ``asyncrl.algorithms.corrections``.

Per token, with ``r = exp(logp - old_logp)`` and ``w`` the truncated weight::

    term = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3 - entropy_coef * H

Multi-turn trajectories (``Sample.loss_mask``) are scored as one sequence each, environment tokens included as
context, but every term, the normalisers and the sequence-level importance weight count model tokens only, so
a single-turn sample (no mask) gives exactly the numbers it gave before masks existed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from asyncrl.algorithms.advantages import Estimator, group_advantages
from asyncrl.algorithms.corrections import (
    Correction,
    m2po_mask,
    masked_weights,
    staleness_metrics,
    token_staleness,
)
from asyncrl.algorithms.logprobs import PLAIN, ScoringOptions, completion_logprobs
from asyncrl.algorithms.reference import Reference, reference_logprobs
from asyncrl.algorithms.rows import to_device
from asyncrl.config import ConfigError, SamplingConfig
from asyncrl.config_base import Flag, NonNegativeFloat, config, require
from asyncrl.types import Rollout, RolloutGroup


class LengthNorm(str, enum.Enum):
    """How per-token terms become a scalar (see ``normalise``)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"
    DR_GRPO = "dr_grpo"


class IsLevel(str, enum.Enum):
    """Where the proximal/behaviour importance weight applies."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    NONE = "none"


@config
class LossConfig:
    """The policy loss. Defaults: GRPO advantages, DAPO's asymmetric clip, token-level IS truncation. The
    scoring temperature and the token budget are not here: ``GRPOLoss`` takes them from ``SamplingConfig``."""

    estimator: Annotated[Estimator, Field(description=(
        "baseline: 'grpo' (group mean) or 'rloo' (mean of the other rollouts)"))] = Estimator.GRPO
    scale_by_std: Annotated[Flag, Field(description=(
        "divide advantages by the group's reward std (False with 'grpo' = Dr. GRPO)"))] = True
    length_norm: Annotated[LengthNorm, Field(description=(
        "how per-token terms become a scalar (see ``normalise``); 'dr_grpo' divides by the sampling "
        "max_tokens"))] = LengthNorm.TOKEN_MEAN
    clip_low: Annotated[float, Field(strict=True, ge=0, lt=1, description=(
        "the ratio to the proximal policy is clipped below at 1 - clip_low"))] = 0.2
    clip_high: Annotated[NonNegativeFloat, Field(description=(
        "... and above at 1 + clip_high (a higher top keeps rare tokens learnable)"))] = 0.28
    is_level: Annotated[IsLevel, Field(description=(
        "proximal/behaviour importance weight per token, per sequence, or none"))] = IsLevel.TOKEN
    is_cap: Annotated[float, Field(strict=True, gt=0, description=(
        "importance weights are truncated at this value (math.inf = no truncation)"))] = 2.0
    correction: Annotated[Correction, Field(description=(
        "what happens to a token whose behaviour ratio is far from 1 (``corrections``): 'truncate' (cap at "
        "is_cap), 'mask' (drop terms whose ratio, per is_level, leaves [1/is_cap, is_cap]) or 'm2po' (drop the "
        "largest squared log-ratios until their mean is <= m2_threshold; is_level, is_cap and the clip are then "
        "unused). Truncation suits groups a version or two old; for groups trained at a staleness of 4 or 8, "
        "'m2po' kept learning where truncation did not (bench.cpu.learning)"))] = Correction.TRUNCATE
    m2_threshold: Annotated[NonNegativeFloat, Field(description=(
        "M2PO's bound on the mean squared log-ratio of the tokens kept (the paper's default)"))] = 0.04
    m2_trust_region: Annotated[Flag, Field(description=(
        "M2PO: only tokens the update pushes further from ratio 1 may be masked"))] = True
    kl_coef: Annotated[NonNegativeFloat, Field(description=(
        "weight of the k3 KL penalty towards a frozen reference (0 = no reference)"))] = 0.0
    entropy_coef: Annotated[NonNegativeFloat, Field(description=(
        "weight of the entropy bonus (0 = entropy is not computed)"))] = 0.0

    @model_validator(mode="after")
    def _masking_rules(self) -> LossConfig:
        if self.correction == Correction.MASK:
            require(self.is_level != IsLevel.NONE, self, "is_level", "must be 'token' or 'sequence' with 'mask'")
            require(self.is_cap >= 1, self, "is_cap",
                    f"must be >= 1 with correction='mask' (the kept range is [1/is_cap, is_cap]), got {self.is_cap!r}")
        return self


@dataclass(frozen=True, slots=True)
class LossOutput:
    """What a loss hands the learner for one (micro-)batch."""

    loss: Tensor  # scalar with grad, already normalised per ``LossConfig.length_norm``
    # ``loss/*`` and ``train/*`` gauges of this batch. Values may be 0-dim tensors: the learner reads them all
    # at once after the step's last backward, since each read of a device value stalls the host until then.
    metrics: Mapping[str, float | Tensor]
    num_tokens: int  # completion tokens scored, for weighting micro-batches against each other


class Loss(Protocol):
    """A training objective over rollout groups. Subclass it to inherit the defaults (``inert``)."""

    # Samples per group below which the loss has nothing to learn from (GRPO: 2, a baseline needs company).
    # The pipeline refuses a ``SamplingConfig.n`` below it.
    min_group_size: int

    def compute(self, model: torch.nn.Module, groups: Sequence[RolloutGroup], *,
                scoring: ScoringOptions = PLAIN) -> LossOutput:
        """Score ``groups`` under ``model`` and return a loss to backpropagate. Called by the learner once
        per micro-batch; a micro-batch holds whole groups, so group baselines are never split. ``scoring``
        (from the learner's config) goes to every ``completion_logprobs`` call the loss makes."""
        ...

    def inert(self, group: RolloutGroup) -> bool:
        """True when every term of this group's loss has zero gradient, so the learner may skip scoring it
        (``LearnerConfig.skip_inert_groups``). Default: False, every group is scored."""
        return False


# ---------------------------------------------------------------------------------------------- pure parts


def importance_weights(
    old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: IsLevel | str, cap: float
) -> tuple[Tensor, Tensor]:
    """Truncated proximal/behaviour weights ``[B, T]`` and a float flag of where the cap bit, both detached.

    ``"sequence"`` uses the product of the token ratios, ``exp(sum_t log_ratio)``, broadcast to tokens.
    The cap is applied in log space, so a huge sequence ratio saturates at ``cap`` instead of overflowing.
    """
    log_ratio = torch.where(mask > 0, old_logp - behaviour_logp, 0.0).detach()
    if level == "none":
        return torch.ones_like(log_ratio), torch.zeros_like(log_ratio)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask)
    log_cap = math.log(cap)
    return log_ratio.clamp(max=log_cap).exp(), (log_ratio > log_cap).float()


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """``min(r A, clip(r) A)`` per token, and a float flag of where the clipped side won (zero gradient)."""
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 KL estimator ``exp(x) - x - 1`` with ``x = log(p / q)`` at a sample from ``q``:
    unbiased for ``KL(q || p)``, never negative, and lower-variance than ``-x``."""
    return torch.exp(log_ratio) - log_ratio - 1


def normalise(per_token: Tensor, mask: Tensor, cfg: LossConfig, max_tokens: int = 0) -> Tensor:
    """Reduce ``[B, T]`` terms to a scalar.

    - ``token_mean``: sum over every token / number of tokens (long sequences weigh more in total).
    - ``seq_mean``: mean over each sequence's tokens, then over sequences that have any (GRPO's original).
    - ``dr_grpo``: sum over every token / (B * max_tokens), a constant, so no length bias enters the gradient
      (``max_tokens``: the sampling token budget, > 0).
    """
    total = (per_token * mask).sum()
    if cfg.length_norm == "token_mean":
        return total / mask.sum().clamp(min=1)
    if cfg.length_norm == "dr_grpo":
        if max_tokens <= 0:
            raise ValueError(f"length_norm='dr_grpo' needs the sampling max_tokens (> 0), got {max_tokens}")
        return total / (mask.shape[0] * max_tokens)
    lengths = mask.sum(dim=-1)
    per_sequence = (per_token * mask).sum(dim=-1) / lengths.clamp(min=1)
    return per_sequence.sum() / (lengths > 0).sum().clamp(min=1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over real tokens as a detached 0-dim tensor (0 when there are none)."""
    return (values.detach() * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    staleness: Tensor | None = None,
    max_tokens: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled clipped objective (module docstring) as a scalar, plus its ``loss/*`` metrics (detached
    0-dim tensors), under ``cfg.correction`` (``asyncrl.algorithms.corrections``).

    ``logp`` (current, with grad), ``old_logp`` (proximal; pass ``logp.detach()`` when the learner has no
    separate one), ``behaviour_logp``, ``ref_logp``, ``entropy``, ``staleness`` (versions behind the learner,
    for the per-bucket gauges) and ``mask`` are ``[B, T]``; ``advantages`` is ``[B]``. Values at padding are
    ignored. ``loss/is_weight_mean`` counts a masked token as weight 0, as the loss does. ``max_tokens`` is the
    sampling token budget, needed by ``length_norm='dr_grpo'``.
    """
    _check_shapes(logp, old_logp, behaviour_logp, advantages, mask, ref_logp, entropy, cfg, staleness)
    mask = mask.to(logp.dtype)
    logp = torch.where(mask > 0, logp, old_logp.detach())  # padding gets ratio 1 whatever it holds
    behaviour_log_ratio = torch.where(mask > 0, old_logp - behaviour_logp, 0.0).detach()
    weight, truncated, masked = _corrected_weights(logp, old_logp, behaviour_logp, advantages, mask, cfg)
    if cfg.correction == Correction.M2PO:  # the second-moment bound replaces the clip
        surrogate = torch.exp(logp - old_logp.detach()) * advantages[:, None]
        clipped = torch.zeros_like(mask)
    else:
        surrogate, clipped = clipped_surrogate(logp, old_logp, advantages[:, None], cfg.clip_low, cfg.clip_high)
    policy = normalise(-(weight * surrogate), mask, cfg, max_tokens)
    loss = policy
    metrics = {
        "loss/policy": policy.detach(),
        "loss/clip_frac": masked_mean(clipped, mask),
        "loss/is_trunc_frac": masked_mean(truncated, mask),
        "loss/is_masked_frac": masked_mean(masked, mask),
        "loss/is_weight_mean": masked_mean(weight, mask),
        "loss/ratio_behaviour_mean": masked_mean(behaviour_log_ratio.exp(), mask),
        "loss/approx_kl_behaviour": masked_mean(k3(behaviour_log_ratio), mask),
        "loss/m2_behaviour": masked_mean(behaviour_log_ratio.square(), mask),
    }
    if staleness is not None:
        truncating = cfg.correction == Correction.TRUNCATE
        metrics.update(staleness_metrics(staleness, mask, truncated if truncating else masked,
                                         "is_trunc_frac" if truncating else "is_masked_frac",
                                         kl=k3(behaviour_log_ratio)))
    if ref_logp is not None:
        kl = k3(torch.where(mask > 0, ref_logp.detach() - logp, 0.0))
        loss = loss + cfg.kl_coef * normalise(kl, mask, cfg, max_tokens)
        metrics["loss/kl"] = masked_mean(kl, mask)
    if entropy is not None:
        loss = loss - cfg.entropy_coef * normalise(entropy, mask, cfg, max_tokens)
        metrics["loss/entropy"] = masked_mean(entropy, mask)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def _corrected_weights(logp: Tensor, old_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor,
                       cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Detached per-token weights under ``cfg.correction``, with float flags of the capped and the masked tokens.
    The weight is proximal/behaviour; M2PO's second moment measures the current policy instead, as the paper
    does, so a learner taking several steps per batch is bounded by the weights it is moving."""
    if cfg.correction == Correction.TRUNCATE:
        weight, truncated = importance_weights(old_logp, behaviour_logp, mask, cfg.is_level, cfg.is_cap)
        return weight, truncated, torch.zeros_like(mask)
    none = torch.zeros_like(mask)
    log_ratio = torch.where(mask > 0, old_logp - behaviour_logp, 0.0).detach()
    if cfg.correction == Correction.M2PO:
        current = torch.where(mask > 0, logp.detach() - behaviour_logp, 0.0)
        masked = m2po_mask(current, mask, advantages, cfg.m2_threshold, cfg.m2_trust_region)
        return torch.where(masked > 0, 0.0, log_ratio.exp()), none, masked
    weight, masked = masked_weights(log_ratio, mask, cfg.is_level, cfg.is_cap)
    return weight, none, masked


def _check_shapes(
    logp: Tensor, old_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor,
    ref_logp: Tensor | None, entropy: Tensor | None, cfg: LossConfig, staleness: Tensor | None = None,
) -> None:
    named = {"old_logp": old_logp, "behaviour_logp": behaviour_logp, "mask": mask,
             "ref_logp": ref_logp, "entropy": entropy, "staleness": staleness}
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, tokens], got shape {tuple(logp.shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [{logp.shape[0]}] (one per sequence), got {tuple(advantages.shape)}")
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logp")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("LossConfig.entropy_coef > 0 needs entropy")


# ------------------------------------------------------------------------------------------------ GRPOLoss


class GRPOLoss(Loss):
    """GRPO / RLOO / Dr. GRPO advantages under the decoupled objective; implements ``Loss``."""

    min_group_size = 2  # a single sample has no group baseline: its advantage is 0 and nothing is learned

    def __init__(self, cfg: LossConfig, *, sampling: SamplingConfig | None = None, pad_id: int = 0,
                 ref_model: Reference | None = None) -> None:
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("LossConfig.kl_coef > 0 needs a ref_model")
        if sampling is None and cfg.length_norm == LengthNorm.DR_GRPO:
            raise ConfigError("GRPOLoss.sampling", "length_norm='dr_grpo' divides by the sampling max_tokens: "
                                                   "pass the SamplingConfig the groups are sampled with")
        self.cfg = cfg  # the loss settings
        # Scored at the temperature the engine sampled at; the sampling token budget is dr_grpo's denominator.
        self.sampling = sampling or SamplingConfig()
        self.pad_id = pad_id  # token id used for padding; any id inside the vocabulary works
        self.ref_model = ref_model  # the KL term's frozen reference (``algorithms.reference``), scored without grad

    def compute(
        self, model: torch.nn.Module, groups: Sequence[RolloutGroup], *, proximal_logp: Tensor | None = None,
        policy_version: int | None = None, scoring: ScoringOptions = PLAIN,
    ) -> LossOutput:
        """Loss of ``groups`` under ``model``.

        ``proximal_logp`` ``[B, T]`` (rollouts in group order) is for learners that take several optimiser
        steps per batch; without it the proximal policy is the current one, detached (ratio 1, no clipping;
        the importance weight still corrects for staleness). ``policy_version`` is what token staleness is
        measured from (``corrections.token_staleness``; default: the newest version among the groups).
        """
        rollouts = _rollouts_of(groups)
        prompts = [g.prompt.token_ids for g in groups for _ in g.rollouts]
        completions = [r.sample.token_ids for r in rollouts]
        masks = [r.sample.loss_mask for r in rollouts]  # multi-turn: environment tokens stay out of the loss
        scored = completion_logprobs(model, prompts, completions, temperature=self.sampling.temperature,
                                     pad_id=self.pad_id, with_entropy=self.cfg.entropy_coef > 0,
                                     loss_masks=masks if any(m is not None for m in masks) else None,
                                     scoring=scoring)
        device = scored.logprobs.device
        advantages = self.advantages(groups)
        behaviour = _padded([r.sample.logprobs for r in rollouts], scored.mask.shape[1], device)
        old = scored.logprobs.detach() if proximal_logp is None else proximal_logp
        staleness = to_device(token_staleness(rollouts, scored.mask.shape[1], policy_version), device)
        loss, metrics = policy_loss(scored.logprobs, old, behaviour, to_device(advantages.numpy(), device), scored.mask,
                                    self.cfg, ref_logp=self._ref_logprobs(model, prompts, completions, scoring),
                                    entropy=scored.entropy, staleness=staleness, max_tokens=self.sampling.max_tokens)
        out: dict[str, float | Tensor] = {**metrics, **_batch_metrics(rollouts, advantages)}
        return LossOutput(loss=loss, metrics=out, num_tokens=scored.num_scored)

    def inert(self, group: RolloutGroup) -> bool:
        # Equal rewards give every rollout advantage 0, so each policy term is 0 * (bounded ratio terms) with
        # zero gradient; only the KL and entropy terms could still move the weights.
        if self.cfg.kl_coef > 0 or self.cfg.entropy_coef > 0:
            return False
        rewards = group.rewards
        return len(rewards) <= 1 or all(r == rewards[0] for r in rewards)

    def advantages(self, groups: Sequence[RolloutGroup]) -> Tensor:
        """One advantage per rollout ``[B]``, each group normalised on its own (sizes may differ)."""
        per_group = [
            group_advantages(torch.tensor([g.rewards], dtype=torch.float32), self.cfg.estimator,
                             self.cfg.scale_by_std)[0]
            for g in groups
        ]
        return torch.cat(per_group)

    def _ref_logprobs(self, model: torch.nn.Module, prompts: list[tuple[int, ...]],
                      completions: list[tuple[int, ...]], scoring: ScoringOptions) -> Tensor | None:
        if self.ref_model is None:
            return None
        return reference_logprobs(self.ref_model, model, prompts, completions,
                                  temperature=self.sampling.temperature, pad_id=self.pad_id, scoring=scoring)


def _rollouts_of(groups: Sequence[RolloutGroup]) -> list[Rollout]:
    for g in groups:
        if not g.rollouts:
            raise ValueError(f"group {g.group_id} has no rollouts")
    if not groups:
        raise ValueError("compute needs at least one group")
    return [r for g in groups for r in g.rollouts]


def _padded(rows: Sequence[Sequence[float]], width: int, device: torch.device) -> Tensor:
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return to_device(out, device)


def _batch_metrics(rollouts: Sequence[Rollout], advantages: Tensor) -> dict[str, float]:
    return {
        "train/reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
        "train/adv_abs_mean": float(advantages.abs().mean()),
        "train/completion_len_mean": sum(len(r.sample.token_ids) for r in rollouts) / len(rollouts),
    }
