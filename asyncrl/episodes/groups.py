"""``EpisodeGroups``: a group is ``n`` multi-turn episodes of an environment, played through ``EpisodeRunner``."""

from __future__ import annotations

from asyncrl.engines.protocols import PromptRejected
from asyncrl.episodes.runner import EpisodeCounters, EpisodeRunner, episode_metrics
from asyncrl.episodes.types import EnvFactory
from asyncrl.errors import RolloutDropped
from asyncrl.groups.maker import GroupMaker, GroupRequest, check_prompt
from asyncrl.groups.scoring import RewardFn, RewardScorer
from asyncrl.types import DropReason, Rollout, RolloutGroup

__all__ = ["EpisodeGroups"]


class EpisodeGroups(GroupMaker):
    """Plays ``SamplingConfig.n`` episodes of ``env`` (a factory: one environment per episode) per prompt. A
    rollout's reward is the sum of its environment's step rewards, plus ``reward_fn(prompt, trajectory)`` when one
    is given (scored as ``RewardGroups`` scores). Whatever drops a group on the way (environment, tool, reward) is
    a ``RolloutDropped`` under its reason.

    Metrics: ``episode/*`` (turns, tool calls and errors, environment time: ``episode_metrics``) and, with a
    reward function, ``reward/overrunning``."""

    def __init__(self, env: EnvFactory, reward_fn: RewardFn | None = None) -> None:
        if not callable(env):
            raise TypeError(f"EpisodeGroups needs an environment factory (prompt) -> Env, got {env!r}")
        self.env = env
        self.reward_fn = reward_fn
        self.scorer = RewardScorer(reward_fn) if reward_fn is not None else None
        self.counters = EpisodeCounters()

    async def make(self, request: GroupRequest) -> RolloutGroup:
        check_prompt(request)
        runner = EpisodeRunner(request.sampler, self.env, request.config, self.counters)
        try:
            episodes = await runner.run_group(request.group_id, request.prompt)
        except PromptRejected as exc:
            raise RolloutDropped(DropReason.PROMPT_TOO_LONG if exc.too_long else DropReason.ENGINE_ERROR,
                                 str(exc)) from exc
        trajectories = [e.trajectory for e in episodes]
        rewards = [e.env_reward for e in episodes]
        if self.scorer is not None:  # a reward over the whole trajectory, added to the environment's
            extra = await self.scorer.score(request.prompt, trajectories, request.config)
            rewards = [a + b for a, b in zip(rewards, extra)]
        rollouts = tuple(Rollout(t, r) for t, r in zip(trajectories, rewards))
        return RolloutGroup(request.group_id, request.prompt, rollouts)

    def metrics(self) -> dict[str, float]:
        out = episode_metrics([self.counters])
        if self.scorer is not None:
            out["reward/overrunning"] = self.scorer.overrunning
        return out

    def fork(self) -> EpisodeGroups:
        return EpisodeGroups(self.env, self.reward_fn)
