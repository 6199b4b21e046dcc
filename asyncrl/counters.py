"""Accounting for rollout groups: every group is trained on or dropped with a counted reason.

Each component keeps its own books and is the only one to write them: the producer's ``ProducerCounters``
(groups it made, groups it dropped before the queue), the queue's ``QueueCounters`` (groups that entered, were
handed out, or were dropped inside it) and the learner's ``LearnerCounters`` (groups trained, groups dropped
at consumption). ``add_up`` turns them into the ``GroupTotals`` that ``RunResult``, checkpoints and the
``groups/*`` metrics report; ``Books`` keeps hold of the books a learner's groups pass through, to add them up
on demand, and writes none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from asyncrl.types import DropReason


class Drops(dict[DropReason, int]):
    """Groups dropped, by reason. A reason never seen reads 0 and is not stored, so a reason present is one seen.
    A plain dict otherwise (``dataclasses.asdict`` and JSON keep it as it is)."""

    def __missing__(self, reason: DropReason) -> int:
        return 0

    def add(self, reason: DropReason, count: int = 1) -> None:
        if count:
            self[reason] = self[reason] + count

    def merge(self, other: Mapping[DropReason, int]) -> None:
        """Add ``other``'s counts to these."""
        for reason, count in other.items():
            self.add(reason, count)

    def describe(self) -> str:
        """``"stale 3, reward_invalid 40"``, most first, or ``"none"``: for error messages."""
        ranked = sorted(self.items(), key=lambda item: -item[1])
        return ", ".join(f"{r.value} {c}" for r, c in ranked if c) or "none"


class ProducerBooks(Protocol):
    """What ``add_up`` reads of a producer's counters."""

    @property
    def dropped(self) -> Mapping[DropReason, int]: ...  # groups dropped before the queue


class QueueBooks(Protocol):
    """What ``add_up`` reads of a queue's counters."""

    @property
    def entered(self) -> int: ...  # groups stored in the queue

    @property
    def dropped(self) -> Mapping[DropReason, int]: ...  # groups dropped inside it (stale, unused at close)


class LearnerBooks(Protocol):
    """What ``add_up`` reads of a learner's counters."""

    @property
    def groups_trained(self) -> int: ...

    @property
    def samples_trained(self) -> int: ...

    @property
    def dropped(self) -> Mapping[DropReason, int]: ...  # groups handed to it that never reached the loss


@dataclass(frozen=True, slots=True)
class GroupTotals:
    """What the books add up to, at one moment. Built by ``add_up`` (or read from a checkpoint); never written."""

    queued: int = 0  # groups that entered the queue
    trained: int = 0  # groups that reached the loss
    samples_trained: int = 0  # rollouts in those groups
    dropped: Drops = field(default_factory=Drops)  # groups dropped anywhere, by reason
    dropped_before_queue: int = 0  # part of ``dropped`` that never entered the queue

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def unaccounted(self, in_queue: int) -> int:
        """Queued groups neither trained, dropped nor still queued. Zero when the books balance."""
        dropped_from_queue = self.total_dropped - self.dropped_before_queue
        return self.queued - self.trained - dropped_from_queue - in_queue

    def describe_drops(self) -> str:
        """``"stale 3, reward_invalid 40"``, or ``"none"``: for error messages."""
        return self.dropped.describe()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"groups/queued": self.queued, "groups/trained": self.trained,
                                 "groups/dropped": self.total_dropped}
        for reason, count in self.dropped.items():
            out[f"groups/dropped_{reason.value}"] = count
        return out


def add_up(queue: QueueBooks, learner: LearnerBooks, producers: Iterable[ProducerBooks] = (),
           previous: GroupTotals = GroupTotals()) -> GroupTotals:
    """The totals of one pipeline's books, plus ``previous`` (the runs a resumed one continues)."""
    before = Drops()
    for producer in producers:
        before.merge(producer.dropped)
    dropped = Drops(previous.dropped)
    for part in (before, queue.dropped, learner.dropped):
        dropped.merge(part)
    return GroupTotals(queued=previous.queued + queue.entered, trained=previous.trained + learner.groups_trained,
                       samples_trained=previous.samples_trained + learner.samples_trained, dropped=dropped,
                       dropped_before_queue=previous.dropped_before_queue + sum(before.values()))


class Books:
    """The books a learner's groups pass through: its queue's, its own, and those of the producers feeding it
    (a ``Pipeline`` includes its producers; remote producers keep theirs in their own process). Reads them,
    never writes them."""

    def __init__(self, queue: QueueBooks, learner: LearnerBooks) -> None:
        self.queue = queue
        self.learner = learner
        self.producers: list[ProducerBooks] = []
        self.previous = GroupTotals()  # what a resumed run's checkpoint had counted

    def include(self, producer: ProducerBooks) -> None:
        """Add a producer's books to the totals (once, however often it is included)."""
        if not any(p is producer for p in self.producers):
            self.producers.append(producer)

    def carry(self, previous: GroupTotals) -> None:
        """Continue from a checkpoint's totals (``checkpoint.store.restored_counters``)."""
        self.previous = previous

    def totals(self) -> GroupTotals:
        return add_up(self.queue, self.learner, self.producers, self.previous)
