"""``RewardGroups``: the plain GRPO way, ``n`` completions of a prompt each scored by a reward function."""

from __future__ import annotations

from asyncrl.groups.maker import GroupMaker, GroupRequest, check_prompt, sample_completions
from asyncrl.groups.scoring import RewardFn, RewardScorer
from asyncrl.types import Rollout, RolloutGroup

__all__ = ["RewardGroups"]


class RewardGroups(GroupMaker):
    """Samples ``SamplingConfig.n`` completions per prompt and scores each with ``reward_fn(prompt, sample)``
    (sync or async; ``asyncrl.groups.scoring`` says where it runs and how it is bounded)."""

    def __init__(self, reward_fn: RewardFn) -> None:
        if not callable(reward_fn):
            raise TypeError(f"RewardGroups needs a reward function (prompt, sample) -> float, got {reward_fn!r}")
        self.reward_fn = reward_fn
        self.scorer = RewardScorer(reward_fn)

    async def make(self, request: GroupRequest) -> RolloutGroup:
        check_prompt(request)
        samples = await sample_completions(request)
        rewards = await self.scorer.score(request.prompt, samples, request.config)
        return RolloutGroup(request.group_id, request.prompt, tuple(Rollout(s, r) for s, r in zip(samples, rewards)))

    def metrics(self) -> dict[str, float]:
        return {"reward/overrunning": self.scorer.overrunning}

    def fork(self) -> RewardGroups:
        return RewardGroups(self.reward_fn)
