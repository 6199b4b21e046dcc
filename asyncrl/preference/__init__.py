"""Online preference optimisation: pairwise judges, Online DPO / XPO / Nash-MD losses, and their recipe."""

from asyncrl.preference.groups import OPPONENTS, JudgeCounters, JudgedGroups
from asyncrl.preference.judges import HttpJudge, JudgeFn, RewardModelJudge, judge_from_reward
from asyncrl.preference.losses import (
    NashMDLoss,
    OnlineDPOLoss,
    PreferenceConfig,
    PreferenceLossType,
    XPOLoss,
    dpo_losses,
    nash_md_losses,
)
from asyncrl.preference.mixture import MixtureSampler
from asyncrl.preference.recipe import Trainer, preference_pipeline

__all__ = ["OPPONENTS", "HttpJudge", "JudgeCounters", "JudgeFn", "JudgedGroups", "MixtureSampler", "NashMDLoss",
           "OnlineDPOLoss", "PreferenceConfig", "PreferenceLossType", "RewardModelJudge", "Trainer", "XPOLoss",
           "dpo_losses", "judge_from_reward", "nash_md_losses", "preference_pipeline"]
