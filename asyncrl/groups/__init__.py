"""How a prompt becomes a scored group: the ``GroupMaker`` role (``maker``), the reward and judge call machinery
(``scoring``) and the plain reward-scored maker (``rewarded``). Episodes, judged pairs and agent sessions are makers
of their own packages (``asyncrl.episodes``, ``asyncrl.preference``, ``asyncrl.agents``)."""

from asyncrl.groups.maker import GroupMaker, GroupRequest, SamplingBooks, check_prompt, sample_completions
from asyncrl.groups.rewarded import RewardGroups
from asyncrl.groups.scoring import RewardFn, RewardRejected, RewardScorer, ScoringKind

__all__ = ["GroupMaker", "GroupRequest", "RewardFn", "RewardGroups", "RewardRejected", "RewardScorer",
           "SamplingBooks", "ScoringKind", "check_prompt", "sample_completions"]
