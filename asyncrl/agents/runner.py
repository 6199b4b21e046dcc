"""``AgentRunner``: black-box agents played through the endpoint, ``n`` episodes per task, into GRPO groups.

An agent is any function ``agent(base_url, api_key, task) -> result`` (async, or sync and then run in a worker
thread) that talks to ``base_url`` with an OpenAI client; ``task`` is the prompt's text. Each episode gets a
session of its own, so its calls become its trajectories. The episode's reward is ``reward_fn(prompt, result)``
(sync or async, run as rewards are: threads, limiter, timeout), or, without one, what was posted to the
session's reward route (``POST {base_url}/../reward``, ``{"reward": x}``).

Every trajectory of a task's episodes joins one ``RolloutGroup`` with its episode's reward (an episode its agent
split into k trajectories gives k rollouts). The group's prompt is the longest prefix the trajectories' first
prompts share; the rest of each one's prompt enters its trajectory out of the loss, so every row is exactly the
context its model turns saw. A group is dropped, with its reason, when an agent raises (``agent_error``),
overruns ``AgentConfig.timeout_s`` (``agent_timeout``), makes no call (``agent_idle``) or its reward fails.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from pydantic import Field

from asyncrl.agents.endpoint import AgentEndpoint
from asyncrl.agents.sessions import Session
from asyncrl.aio import together
from asyncrl.config import ProducerConfig
from asyncrl.config_base import Seconds, config
from asyncrl.errors import RolloutDropped
from asyncrl.groups.maker import GroupMaker, GroupRequest
from asyncrl.groups.scoring import RewardRejected, RewardScorer, is_async_callable
from asyncrl.types import DropReason, Prompt, Rollout, RolloutGroup, Trajectory, VersionSpan

AgentFn = Callable[[str, str, str], "Awaitable[Any] | Any"]
AgentRewardFn = Callable[[Prompt, Any], "Awaitable[float] | float"]


@config
class AgentConfig:
    """How the runner treats agents."""

    timeout_s: Annotated[Seconds, Field(description=(
        "bound on a group's episodes, all together; over it the group is dropped (``agent_timeout``)"))] = 300.0


@dataclass(slots=True)
class AgentCounters:
    """The runner's books (``agent/*`` metrics)."""

    episodes: int = 0  # finished episodes of groups that were built
    calls: int = 0  # completion calls in those
    trajectories: int = 0
    splits: int = 0  # calls that could not extend their session's trajectory (history rewritten)
    extensions: int = 0


class AgentRunner(GroupMaker):
    """The agents' group maker: a producer's prompt is a task for ``n`` agents (``grpo_pipeline(engine, model,
    prompts, runner)``); or played on its own (``build_group``). The agents talk to the endpoint, not to the
    request's sampler: the endpoint's engine is what they sample from."""

    def __init__(self, endpoint: AgentEndpoint, agent: AgentFn, reward_fn: AgentRewardFn | None = None,
                 config: AgentConfig | None = None) -> None:
        self.endpoint = endpoint
        self.agent = agent
        self.reward_fn = reward_fn
        self.config = config or AgentConfig()
        self.scorer = RewardScorer(reward_fn) if reward_fn is not None else None
        self.counters = AgentCounters()

    async def make(self, request: GroupRequest) -> RolloutGroup:
        return await self.build_group(request.group_id, request.prompt, config=request.config)

    def fork(self) -> AgentRunner:
        return AgentRunner(self.endpoint, self.agent, self.reward_fn, self.config)

    async def build_group(self, group_id: str, prompt: Prompt, n: int | None = None, *,
                          config: ProducerConfig | None = None) -> RolloutGroup:
        """``n`` (default ``config.sampling.n``) episodes of ``prompt``'s task as one group, under ``config``'s
        reward limits (default ``ProducerConfig()``); raises ``RolloutDropped`` naming why it cannot be trained."""
        config = config or ProducerConfig()
        n = config.sampling.n if n is None else n
        keys = [f"e{uuid.uuid4().hex[:16]}" for _ in range(n)]
        urls = [self.endpoint.open_session(k) for k in keys]
        try:
            results = await self._play(urls, prompt)
        finally:
            sessions = [self.endpoint.close_session(k) for k in keys]
        rewards = await self._rewards(prompt, results, sessions, config)
        return self._group(group_id, prompt, sessions, rewards)

    async def _play(self, urls: Sequence[str], prompt: Prompt) -> list[Any]:
        limit = self.config.timeout_s
        try:
            async with asyncio.timeout(limit) as scope:
                return await together(*(self._one(url, prompt.text) for url in urls))
        except TimeoutError:
            if scope.expired():
                raise RolloutDropped(DropReason.AGENT_TIMEOUT, f"the agents of {prompt.prompt_id!r} took longer "
                                                               f"than AgentConfig.timeout_s={limit}s") from None
            raise RolloutDropped(DropReason.AGENT_ERROR, "an agent raised TimeoutError") from None
        except RolloutDropped:
            raise
        except Exception as exc:  # cancellation is a BaseException: it passes through untouched
            raise RolloutDropped(DropReason.AGENT_ERROR, f"an agent of {prompt.prompt_id!r} raised {exc!r}") from exc

    async def _one(self, url: str, task: str) -> Any:
        token = self.endpoint.config.token
        if is_async_callable(self.agent):
            return await self.agent(url, token, task)
        # A synchronous agent (the sync openai client) runs in a thread; a cancelled episode closes its session,
        # so the thread's next call gets a 404 and it ends.
        return await anyio.to_thread.run_sync(self.agent, url, token, task, abandon_on_cancel=True)

    async def _rewards(self, prompt: Prompt, results: Sequence[Any], sessions: Sequence[Session],
                       config: ProducerConfig) -> list[float]:
        if self.scorer is not None:
            rewards = await self.scorer.run_calls([(prompt, r) for r in results], config)
        else:
            rewards = [s.reward for s in sessions]
            if any(r is None for r in rewards):
                raise RewardRejected(DropReason.REWARD_INVALID, "an episode ended without a reward posted to its "
                                                                "session's reward route (and no reward_fn)")
        for r in rewards:
            if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
                raise RewardRejected(DropReason.REWARD_INVALID, f"reward {r!r} is not a finite number")
        return [float(r) for r in rewards]

    def _group(self, group_id: str, prompt: Prompt, sessions: Sequence[Session],
               rewards: Sequence[float]) -> RolloutGroup:
        played = [(s.trajectories(), r) for s, r in zip(sessions, rewards, strict=True)]
        if any(not t for t, _ in played):
            raise RolloutDropped(DropReason.AGENT_IDLE, f"an agent of {prompt.prompt_id!r} ended without a call")
        firsts = [p for t, _ in played for p, _ in t]
        common = _common_prefix(firsts)
        if not common:
            raise RolloutDropped(DropReason.AGENT_ERROR, f"the episodes of {prompt.prompt_id!r} share no prompt "
                                                         "token: they cannot form one group")
        rollouts = tuple(Rollout(_behind(first[len(common):], traj), reward)
                         for trajs, reward in played for first, traj in trajs)
        c = self.counters
        c.episodes += len(sessions)
        c.trajectories += len(rollouts)
        c.calls += sum(s.counters.calls for s in sessions)
        c.splits += sum(s.counters.splits for s in sessions)
        c.extensions += sum(s.counters.extensions for s in sessions)
        group_prompt = Prompt(prompt.prompt_id, common, prompt.text, prompt.answer)
        return RolloutGroup(group_id, group_prompt, rollouts,
                            meta={"episodes": len(sessions), "splits": sum(s.counters.splits for s in sessions)})

    def metrics(self) -> dict[str, float]:
        c = self.counters
        per = 1 / c.episodes if c.episodes else 0.0
        return {"agent/episodes": c.episodes, "agent/trajectories": c.trajectories, "agent/splits": c.splits,
                "agent/calls_per_episode": c.calls * per, **self.endpoint.metrics()}


def _common_prefix(seqs: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    first = seqs[0]
    k = len(first)
    for s in seqs[1:]:
        k = min(k, len(s))
        k = next((i for i in range(k) if s[i] != first[i]), k)
    return first[:k]


def _behind(context: tuple[int, ...], traj: Trajectory) -> Trajectory:
    """``traj`` with ``context`` before it, out of the loss (the part of its prompt the group does not share)."""
    if not context:
        return traj
    k = len(context)
    spans = tuple(VersionSpan(v.version, v.start + k, v.end + k) for v in traj.version_spans)
    return Trajectory(token_ids=context + traj.token_ids, logprobs=(0.0,) * k + traj.logprobs,
                      finish_reason=traj.finish_reason, version_spans=spans, text=traj.text,
                      loss_mask=(0,) * k + traj.loss_mask)
