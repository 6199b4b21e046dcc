"""The producer actor: prompts -> engine -> scored, version-tagged rollout groups -> queue.

Each producer keeps at most ``max_inflight_groups`` groups in flight. A group is put into the sink (a local
``RolloutQueue`` or a ``RemoteQueueClient``) only when all its samples are finished and scored; putting
waits while the queue is full, which is how backpressure reaches generation.

Abort pauses: samples cut by an ``abort`` pause finish with ``FinishReason.ABORT``. With
``AbortPolicy.RESUBMIT`` (default) just those samples are sampled again (they wait in the engine until it
resumes, so they come from the new weights); with ``AbortPolicy.DROP`` the group is dropped and counted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asyncrl.config import AbortPolicy, InvalidGroupPolicy, ProducerConfig
from asyncrl.data import PromptSource
from asyncrl.engines.base import Engine, PromptRejected
from asyncrl.ledger import GroupLedger
from asyncrl.queues.rollout_queue import QueueClosed
from asyncrl.types import DropReason, FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan

log = logging.getLogger(__name__)

RewardFn = Callable[[Prompt, Sample], "float | Awaitable[float]"]


class InvalidGroupError(RuntimeError):
    """A group was invalid and the producer is configured to fail fast (``InvalidGroupPolicy.FAIL``)."""


class _Drop(Exception):
    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(slots=True)
class ProducerStats:
    groups: int = 0  # groups put into the sink
    samples: int = 0  # samples in those groups
    tokens: int = 0  # completion tokens in those groups
    resubmitted: int = 0  # abort-cut samples sampled again
    duplicates: int = 0  # puts the sink reported as already stored


class Producer:
    """Samples a group per prompt, scores it with ``reward_fn`` (sync or async) and ships it to ``sink``."""

    def __init__(self, engine: Engine, prompts: PromptSource, reward_fn: RewardFn, sink: object,
                 config: ProducerConfig | None = None, ledger: GroupLedger | None = None,
                 name: str = "producer") -> None:
        self.engine = engine
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.sink = sink  # anything with ``async put(group) -> bool`` (see asyncrl.queues.remote.GroupSink)
        self.config = config or ProducerConfig()
        self.ledger = ledger if ledger is not None else GroupLedger()
        self.name = name
        self.stats = ProducerStats()
        self.in_flight = 0  # groups being generated or scored right now

    async def run(self) -> None:
        """Produce until the prompt source is exhausted or the task is cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                # One long-lived worker per in-flight slot, not a task per group: the same bound and the
                # same cancellation (every group runs inside a task of this group), without creating,
                # scheduling and reaping a task and taking a semaphore slot for every group.
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
        try:
            await self.produce_one(index, prompt)
        except asyncio.CancelledError:
            # Shutdown or a failure elsewhere: this group never reaches the queue; count it.
            self.ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, queued=False)
            raise
        finally:
            self.in_flight -= 1

    async def produce_one(self, index: int, prompt: Prompt) -> RolloutGroup | None:
        """Generate, score and ship the group for one prompt; None if it was dropped (and counted)."""
        group_id = f"{prompt.prompt_id}#{index}"
        try:
            group = await self._build_group(group_id, prompt)
        except _Drop as drop:
            return self._drop(group_id, drop)
        stored = await self.sink.put(group)  # type: ignore[attr-defined]
        self.stats.groups += 1
        self.stats.samples += len(group.rollouts)
        self.stats.tokens += group.num_tokens
        self.stats.duplicates += 0 if stored else 1
        return group

    def _drop(self, group_id: str, drop: _Drop) -> None:
        if self.config.on_invalid is InvalidGroupPolicy.FAIL and drop.reason is not DropReason.ABORTED:
            raise InvalidGroupError(f"{self.name}: group {group_id} invalid ({drop.reason.value}): {drop}")
        log.warning("%s: dropping group %s (%s): %s", self.name, group_id, drop.reason.value, drop)
        self.ledger.drop(drop.reason, queued=False)
        return None

    async def _build_group(self, group_id: str, prompt: Prompt) -> RolloutGroup:
        self._check_prompt(prompt)
        version_at_submit = self.engine.version
        samples = await self._sample_all(group_id, prompt)
        rollouts = []  # a plain loop: an async comprehension would cost a frame per group
        for sample in samples:
            reward = await self._score(prompt, sample)
            rollouts.append(_rollout(group_id, prompt, sample, reward, version_at_submit))
        return RolloutGroup(group_id=group_id, prompt=prompt, rollouts=tuple(rollouts))

    def _check_prompt(self, prompt: Prompt) -> None:
        if not prompt.token_ids:
            raise _Drop(DropReason.EMPTY_PROMPT, f"prompt {prompt.prompt_id!r} has no tokens")
        if len(prompt.token_ids) >= self.engine.max_model_len:
            raise _Drop(DropReason.PROMPT_TOO_LONG, f"prompt {prompt.prompt_id!r} has {len(prompt.token_ids)} "
                                                    f"tokens; the engine's context is {self.engine.max_model_len}")

    async def _sample_all(self, group_id: str, prompt: Prompt) -> list[Sample]:
        params = self.config.sampling
        try:
            samples = await self.engine.generate(prompt.token_ids, params, request_id=group_id)
            for attempt in range(1, self.config.max_resubmits + 2):
                cut = [i for i, s in enumerate(samples) if s.finish_reason is FinishReason.ABORT]
                if not cut:
                    return samples
                if self.config.on_abort is AbortPolicy.DROP or attempt > self.config.max_resubmits:
                    raise _Drop(DropReason.ABORTED, f"{len(cut)} of {len(samples)} samples cut by an abort pause")
                self.stats.resubmitted += len(cut)
                again = await self.engine.generate(prompt.token_ids, params, request_id=f"{group_id}/r{attempt}",
                                                   n=len(cut))
                for i, s in zip(cut, again):
                    samples[i] = s
        except PromptRejected as exc:
            raise _Drop(DropReason.PROMPT_TOO_LONG, str(exc)) from exc
        raise AssertionError("unreachable")

    async def _score(self, prompt: Prompt, sample: Sample) -> float:
        try:
            value = self.reward_fn(prompt, sample)
            if type(value) is not float and inspect.isawaitable(value):  # a float, the usual, is not
                value = await value
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _Drop(DropReason.REWARD_ERROR, f"reward function raised {exc!r}") from exc
        return _checked_reward(value)


def _checked_reward(value: object) -> float:
    if type(value) is float and math.isfinite(value):  # the usual case, without the ABC checks below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise _Drop(DropReason.REWARD_INVALID, f"reward function returned {value!r}, not a finite number")
    return float(value)


def _rollout(group_id: str, prompt: Prompt, sample: Sample, reward: float, version_at_submit: int) -> Rollout:
    # A sample with no tokens has no spans; its (empty) output belongs to the version it was submitted under.
    spans = sample.version_spans or (VersionSpan(version_at_submit, 0, 0),)
    return Rollout(
        group_id=group_id, prompt_ids=prompt.token_ids, completion_ids=sample.token_ids,
        behaviour_logprobs=sample.logprobs, reward=reward, finish_reason=sample.finish_reason,
        version_spans=spans, version_start=spans[0].version, version_end=spans[-1].version, text=sample.text,
    )
