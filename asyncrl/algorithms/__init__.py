"""Advantages, completion scoring and policy losses for the learner."""

from asyncrl.algorithms.advantages import Estimator, group_advantages
from asyncrl.algorithms.corrections import Correction
from asyncrl.algorithms.logprobs import CompletionLogprobs, ScoringOptions, completion_logprobs
from asyncrl.algorithms.losses import GRPOLoss, IsLevel, LengthNorm, Loss, LossConfig, LossOutput, k3, policy_loss

__all__ = [
    "CompletionLogprobs",
    "Correction",
    "Estimator",
    "GRPOLoss",
    "IsLevel",
    "LengthNorm",
    "Loss",
    "LossConfig",
    "LossOutput",
    "ScoringOptions",
    "completion_logprobs",
    "group_advantages",
    "k3",
    "policy_loss",
]
