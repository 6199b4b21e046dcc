"""Accounting for rollout groups: every group is trained on or dropped with a counted reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from asyncrl.types import DropReason


@dataclass(slots=True)
class GroupCounters:
    """Counts of groups by fate. One instance is shared by the producers, the queue and the learner of a
    pipeline, so the books balance across all three."""

    queued: int = 0  # groups that entered the queue
    trained: int = 0  # groups that reached the loss
    dropped: Counter[DropReason] = field(default_factory=Counter)  # groups dropped, by reason
    dropped_before_queue: int = 0  # part of ``dropped`` that never entered the queue

    def drop(self, reason: DropReason, count: int = 1, *, queued: bool) -> None:
        if count:
            self.dropped[reason] += count
            if not queued:
                self.dropped_before_queue += count

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def unaccounted(self, in_queue: int) -> int:
        """Queued groups neither trained, dropped nor still queued. Zero when the books balance."""
        dropped_from_queue = self.total_dropped - self.dropped_before_queue
        return self.queued - self.trained - dropped_from_queue - in_queue

    def describe_drops(self) -> str:
        """``"stale 3, reward_invalid 40"``, or ``"none"``: for error messages."""
        return ", ".join(f"{r.value} {c}" for r, c in self.dropped.most_common() if c) or "none"

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"groups/queued": self.queued, "groups/trained": self.trained,
                                 "groups/dropped": self.total_dropped}
        for reason, count in self.dropped.items():
            out[f"groups/dropped_{reason.value}"] = count
        return out
