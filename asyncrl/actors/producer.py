"""The producer actor: prompts -> sampler -> scored, version-tagged rollout groups -> sink.

Each producer keeps at most ``max_inflight_groups`` groups in flight. A group is sent to the sink (its own end
of a local rollout queue, or a ``RemoteQueueClient``) only when all its samples are finished and scored;
sending waits while the queue is full, which is how backpressure reaches generation. The producer never
closes its sink: whoever gave it one closes it when the producer's task ends.

Abort pauses: samples cut by an ``abort`` pause finish with ``FinishReason.ABORT``. With
``AbortPolicy.RESUBMIT`` (default) just those samples are sampled again (they wait in the engine until it
resumes, so they come from the new weights); with ``AbortPolicy.DROP`` the group is dropped and counted.

Episodes: a producer given ``env`` (an ``EnvFactory``) plays ``n`` multi-turn episodes per prompt through an
``EpisodeRunner`` instead of sampling ``n`` completions. A rollout's reward is the sum of its environment's step
rewards, plus ``reward_fn(prompt, trajectory)`` when one is given (``reward_fn=None``: the environment's alone).
Whatever drops a group on the way (``RolloutDropped``: environment, tool, reward) is counted under its reason.

Preferences: a producer given ``judge`` (an ``asyncrl.preference.JudgeScorer``) scores its groups with a pairwise
judge instead of ``reward_fn``: each rollout's reward is its preference score, and the opponents' completions (if
any) travel in ``RolloutGroup.opponents``.

Agents: a producer given ``agents`` (an ``asyncrl.agents.AgentRunner``) hands each prompt, as a task, to ``n``
black-box agents talking to the OpenAI-compatible endpoint; the runner builds the group from their sessions.

Admission: before starting a group the producer waits on its ``admission`` (the pipeline's ``AdmissionGate``,
shared by every producer: a group starts only if it can be trained within ``max_staleness``); a group that
never reaches the sink withdraws its ticket. The default, ``OPEN``, starts groups at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncrl.actors.rewards import RewardFn, RewardScorer
from asyncrl.config import AbortPolicy, InvalidGroupPolicy, ProducerConfig
from asyncrl.counters import Drops
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import PromptRejected, Sampler
from asyncrl.episodes.runner import EpisodeRunner, episode_metrics
from asyncrl.episodes.types import EnvFactory
from asyncrl.errors import InvalidGroupError, NoProgressError, QueueClosed, RolloutDropped
from asyncrl.queues.admission import OPEN, Admission
from asyncrl.types import DropReason, FinishReason, Prompt, Rollout, RolloutGroup, Sample

if TYPE_CHECKING:
    from asyncrl.agents.runner import AgentRunner
    from asyncrl.preference.scoring import JudgeScorer

log = logging.getLogger(__name__)

__all__ = ["GroupSink", "Producer", "ProducerCounters", "RewardFn"]


@runtime_checkable
class GroupSink(Protocol):
    """Where a producer ships finished groups: a ``RolloutSender`` or a ``RemoteQueueClient``."""

    async def send(self, group: RolloutGroup) -> bool:
        """Store ``group``, waiting while the sink is full. False if its id was already stored. Raises
        ``QueueClosed`` once the receiving side is closed."""
        ...

    async def aclose(self) -> None:
        """This producer sends no more (idempotent). The pipeline calls it when the producer ends: a queue's
        sending end closes (the queue ends once every one has), a remote client tells its server it is leaving.
        A wrapper must forward it, or the queue never ends."""
        ...


@dataclass(slots=True)
class ProducerCounters:
    """A producer's books, written by it alone (the pipeline adds them into its ``GroupTotals``)."""

    groups: int = 0  # groups sent to the sink
    samples: int = 0  # samples in those groups
    tokens: int = 0  # completion tokens in those groups
    resubmitted: int = 0  # abort-cut samples sampled again
    duplicates: int = 0  # sends the sink reported as already stored
    dropped: Drops = field(default_factory=Drops)  # groups dropped before reaching the sink, by reason
    drops_in_a_row: int = 0  # groups dropped as invalid since the last one sent


class Producer:
    """Samples a group per prompt (or plays ``n`` episodes in ``env``), scores it with ``reward_fn`` (sync or
    async) and ships it to ``sink``."""

    def __init__(self, sampler: Sampler, prompts: PromptSource, reward_fn: RewardFn | None, sink: GroupSink,
                 config: ProducerConfig | None = None, name: str = "producer", *,
                 env: EnvFactory | None = None, admission: Admission = OPEN, judge: JudgeScorer | None = None,
                 agents: AgentRunner | None = None) -> None:
        if judge is not None and (reward_fn is not None or env is not None):
            raise ValueError("a producer scores with a judge or with rewards (reward_fn, env), not both")
        if agents is not None and (reward_fn is not None or env is not None or judge is not None):
            raise ValueError("a producer given agents leaves rewards to its AgentRunner: no reward_fn, env or judge")
        if reward_fn is None and env is None and judge is None and agents is None:
            raise ValueError("a producer needs a reward_fn, an env whose steps give rewards, both, a judge, or "
                             "agents")
        self.sampler = sampler
        self.prompts = prompts
        self.sink = sink
        self.config = config or ProducerConfig()
        self.scorer = RewardScorer(reward_fn, self.config) if reward_fn is not None else None
        self.episodes = EpisodeRunner(sampler, env, self.config) if env is not None else None
        self.judge = judge
        self.agents = agents
        self.name = name
        self.admission = admission  # asked before each group starts (run() only; produce_one is ungated)
        self.counters = ProducerCounters()
        self.in_flight = 0  # groups being generated or scored right now

    async def run(self) -> None:
        """Produce until the prompt source is exhausted, the sink is closed, or the task is cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                # One long-lived worker per in-flight slot, not a task per group: the same bound and the
                # same cancellation, without creating and reaping a task for every group.
                for slot in range(self.config.max_inflight_groups):
                    tg.create_task(self._work(), name=f"{self.name}-slot{slot}")
        except* QueueClosed:
            log.info("%s: queue closed, stopping", self.name)

    async def _work(self) -> None:
        while (item := await self.prompts.next()) is not None:
            await self._guarded(item[0], item[1])
            # A group may finish without ever suspending (an instant engine, a dropped group): yield once
            # per group anyway, so other tasks (the learner, cancellation) always get their turn.
            await asyncio.sleep(0)

    async def _guarded(self, index: int, prompt: Prompt) -> None:
        self.in_flight += 1
        ticket = None
        try:
            ticket = await self.admission.admit()
            if await self.produce_one(index, prompt, ticket) is None:
                self.admission.withdraw(ticket)
            ticket = None  # sent: the queue owns its place now
        except NoProgressError:
            raise  # raised after this group was counted as dropped
        except BaseException:
            # Shutdown, a closed queue, or a failure elsewhere: this group never reaches the queue; count it.
            self.counters.dropped.add(DropReason.UNUSED_AT_SHUTDOWN)
            raise
        finally:
            self.admission.withdraw(ticket)  # None once sent or withdrawn
            self.in_flight -= 1

    async def produce_one(self, index: int, prompt: Prompt, ticket: int | None = None) -> RolloutGroup | None:
        """Generate, score and ship the group for one prompt (with its admission ``ticket``); None if it was
        dropped (and counted)."""
        group_id = f"{prompt.prompt_id}#{index}"
        try:
            group = await self._build_group(group_id, prompt)
        except RolloutDropped as drop:
            return self._drop(group_id, drop)
        stored = await self.sink.send(group if ticket is None else replace(group, ticket=ticket))
        c = self.counters
        c.groups += 1
        c.samples += len(group.rollouts)
        c.tokens += group.num_tokens
        c.duplicates += 0 if stored else 1
        c.drops_in_a_row = 0
        return group

    def _drop(self, group_id: str, drop: RolloutDropped) -> None:
        expected = drop.reason in (DropReason.ABORTED, DropReason.PREFERENCE_TIE)  # outcomes, not invalid input
        if self.config.on_invalid is InvalidGroupPolicy.FAIL and not expected:
            raise InvalidGroupError(f"{self.name}: group {group_id} invalid ({drop.reason.value}): {drop}")
        log.log(logging.DEBUG if drop.reason is DropReason.PREFERENCE_TIE else logging.WARNING,
                "%s: dropping group %s (%s): %s", self.name, group_id, drop.reason.value, drop)
        self.counters.dropped.add(drop.reason)
        self.counters.drops_in_a_row += 1
        if self.counters.drops_in_a_row >= self.config.max_consecutive_drops:
            raise NoProgressError(
                f"{self.name}: the last {self.counters.drops_in_a_row} groups were all dropped, nothing trainable "
                f"is coming (last: {drop.reason.value}: {drop}); drops so far: "
                f"{self.counters.dropped.describe()} (ProducerConfig.max_consecutive_drops)")
        return None

    async def _build_group(self, group_id: str, prompt: Prompt) -> RolloutGroup:
        if self.agents is not None:  # its prompt is a task for the agents: they write what the engine sees
            return await self.agents.build_group(group_id, prompt, self.config.sampling.n)
        self._check_prompt(prompt)
        if self.episodes is not None:
            return await self._build_episodes(group_id, prompt)
        samples = await self._sample_all(group_id, prompt)
        opponents: tuple[Sample, ...] = ()
        if self.judge is not None:
            rewards, opponents = await self.judge.score(group_id, prompt, samples)  # RewardRejected: a drop
        else:
            rewards = await self.scorer.score(prompt, samples)  # type: ignore[union-attr]
        rollouts = tuple(Rollout(s, r) for s, r in zip(samples, rewards))
        return RolloutGroup(group_id=group_id, prompt=prompt, rollouts=rollouts, opponents=opponents)

    async def _build_episodes(self, group_id: str, prompt: Prompt) -> RolloutGroup:
        assert self.episodes is not None
        try:
            episodes = await self.episodes.run_group(group_id, prompt)
        except PromptRejected as exc:
            raise RolloutDropped(DropReason.PROMPT_TOO_LONG if exc.too_long else DropReason.ENGINE_ERROR,
                                 str(exc)) from exc
        trajectories = [e.trajectory for e in episodes]
        rewards = [e.env_reward for e in episodes]
        if self.scorer is not None:  # a reward over the whole trajectory, added to the environment's
            rewards = [a + b for a, b in zip(rewards, await self.scorer.score(prompt, trajectories))]
        rollouts = tuple(Rollout(t, r) for t, r in zip(trajectories, rewards))
        return RolloutGroup(group_id=group_id, prompt=prompt, rollouts=rollouts)

    def _check_prompt(self, prompt: Prompt) -> None:
        if not prompt.token_ids:
            raise RolloutDropped(DropReason.EMPTY_PROMPT, f"prompt {prompt.prompt_id!r} has no tokens")
        if len(prompt.token_ids) >= self.sampler.max_model_len:
            raise RolloutDropped(DropReason.PROMPT_TOO_LONG, f"prompt {prompt.prompt_id!r} has "
                                                             f"{len(prompt.token_ids)} tokens; the engine's context "
                                                             f"is {self.sampler.max_model_len}")
        vocab = self.sampler.vocab_size
        if min(prompt.token_ids) < 0 or max(prompt.token_ids) >= vocab:
            raise RolloutDropped(DropReason.OUT_OF_VOCABULARY, f"prompt {prompt.prompt_id!r} holds a token id outside "
                                                               f"the vocabulary of {self.sampler.name} (ids 0 to "
                                                               f"{vocab - 1})")

    async def _sample_all(self, group_id: str, prompt: Prompt) -> list[Sample]:
        params = self.config.sampling
        try:
            samples = await self.sampler.generate(prompt.token_ids, params, request_id=group_id)
            for attempt in range(1, self.config.max_resubmits + 2):
                cut = [i for i, s in enumerate(samples) if s.finish_reason is FinishReason.ABORT]
                if not cut:
                    return samples
                if self.config.on_abort is AbortPolicy.DROP or attempt > self.config.max_resubmits:
                    raise RolloutDropped(DropReason.ABORTED,
                                         f"{len(cut)} of {len(samples)} samples cut by an abort pause")
                self.counters.resubmitted += len(cut)
                again = await self.sampler.generate(prompt.token_ids, params, request_id=f"{group_id}/r{attempt}",
                                                    n=len(cut))
                for i, s in zip(cut, again):
                    samples[i] = s
        except PromptRejected as exc:
            raise RolloutDropped(DropReason.PROMPT_TOO_LONG if exc.too_long else DropReason.ENGINE_ERROR,
                                 str(exc)) from exc
        raise AssertionError("unreachable")

    def metrics(self) -> dict[str, float]:
        c = self.counters
        out = {"producer/groups": c.groups, "producer/samples": c.samples, "producer/tokens": c.tokens,
               "producer/resubmitted": c.resubmitted, "producer/in_flight": self.in_flight,
               "producer/reward_overrunning": self.scorer.overrunning if self.scorer is not None else 0}
        if self.judge is not None:
            out.update(self.judge.metrics())
        if self.episodes is not None:
            out.update(episode_metrics([self.episodes.counters]))
        if self.agents is not None:
            out.update(self.agents.metrics())
        return out
