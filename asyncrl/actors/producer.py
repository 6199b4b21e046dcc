"""The producer actor: prompts -> group maker -> scored, version-tagged rollout groups -> sink.

Each producer keeps at most ``max_inflight_groups`` groups in flight. How a prompt becomes a scored group is its
maker's (``asyncrl.groups.GroupMaker``: rewards, episodes, judged pairs, agent sessions); the producer owns what is
the same for all of them: admission, the sink, its books and the drop policy. A group is sent to the sink (its own
end of a local rollout queue, or a ``RemoteQueueClient``) only when it is whole and scored; sending waits while the
queue is full, which is how backpressure reaches generation. The producer never closes its sink: whoever gave it
one closes it when the producer's task ends.

Drops: a maker raises ``RolloutDropped`` for a group that cannot be trained; the producer counts it under its
reason, fails the run for an invalid one under ``InvalidGroupPolicy.FAIL``, and stops with ``NoProgressError``
after ``max_consecutive_drops`` in a row.

Admission: before starting a group the producer waits on its ``admission`` (the pipeline's ``AdmissionGate``,
shared by every producer: a group starts only if it can be trained within ``max_staleness``); the ticket travels
beside the group into the sink (the queue's own envelope, never on the message), and a group that never reaches
the sink withdraws it. The default, ``OPEN``, starts groups at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from asyncrl.config import InvalidGroupPolicy, ProducerConfig
from asyncrl.counters import Drops
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Sampler
from asyncrl.errors import InvalidGroupError, NoProgressError, QueueClosed, RolloutDropped
from asyncrl.groups.maker import GroupMaker, GroupRequest, SamplingBooks
from asyncrl.queues.admission import OPEN, Admission
from asyncrl.types import DropReason, Prompt, RolloutGroup

log = logging.getLogger(__name__)

__all__ = ["GroupSink", "Producer", "ProducerCounters"]


@runtime_checkable
class GroupSink(Protocol):
    """Where a producer ships finished groups: a ``RolloutSender`` or a ``RemoteQueueClient``."""

    async def send(self, group: RolloutGroup, *, ticket: int | None = None) -> bool:
        """Store ``group``, waiting while the sink is full. False if its id was already stored. Raises
        ``QueueClosed`` once the receiving side is closed. ``ticket``: its place in start order from the
        pipeline's admission gate (None: not gated); a sink without a gate ignores it."""
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
    sampling: SamplingBooks = field(default_factory=SamplingBooks)  # what its makers' sampling did for it
    duplicates: int = 0  # sends the sink reported as already stored
    dropped: Drops = field(default_factory=Drops)  # groups dropped before reaching the sink, by reason
    drops_in_a_row: int = 0  # groups dropped as invalid since the last one sent


class Producer:
    """Makes a group per prompt with ``groups`` (sampling from ``sampler``) and ships it to ``sink``."""

    def __init__(self, sampler: Sampler, prompts: PromptSource, groups: GroupMaker, sink: GroupSink,
                 config: ProducerConfig | None = None, name: str = "producer", *, admission: Admission = OPEN) -> None:
        if not isinstance(groups, GroupMaker):  # the role's shape, checked once: a reward function is not a maker
            raise TypeError(f"{name}: groups must be a GroupMaker (e.g. asyncrl.RewardGroups(reward_fn)), got "
                            f"{type(groups).__name__}")
        self.sampler = sampler
        self.prompts = prompts
        self.groups = groups
        self.sink = sink
        self.config = config or ProducerConfig()
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
        """Make, score and ship the group for one prompt (with its admission ``ticket``); None if it was dropped
        (and counted)."""
        group_id = f"{prompt.prompt_id}#{index}"  # the queue's de-dup key: a retried send is stored once
        request = GroupRequest(group_id, prompt, self.sampler, self.config, self.counters.sampling)
        try:
            group = await self.groups.make(request)
        except RolloutDropped as drop:
            return self._drop(request.group_id, drop)
        stored = await self.sink.send(group, ticket=ticket)
        c = self.counters
        c.groups += 1
        c.samples += len(group.rollouts)
        c.tokens += group.num_tokens
        c.duplicates += 0 if stored else 1
        c.drops_in_a_row = 0
        return group

    def _drop(self, group_id: str, drop: RolloutDropped) -> None:
        if self.config.on_invalid is InvalidGroupPolicy.FAIL and not drop.reason.is_outcome:
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

    def metrics(self) -> dict[str, float]:
        """The producer's own gauges (its maker's are the pipeline's to add, once for all producers sharing it)."""
        c = self.counters
        return {"producer/groups": c.groups, "producer/samples": c.samples, "producer/tokens": c.tokens,
                "producer/resubmitted": c.sampling.resubmitted, "producer/in_flight": self.in_flight}
