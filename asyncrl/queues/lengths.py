"""Token books of the rollout queue: completion tokens and lengths of every group that finished, by fate.

They measure length bias: streaming hands the learner what finishes first, so without start-order consumption
the trained completions are shorter than the generated ones (``length/trained_mean`` from the learner against
``length/generated_mean`` here), and the tokens dropped as stale are the long ones (``tokens/dropped_stale``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncrl.types import DropReason, RolloutGroup


@dataclass(slots=True)
class TokenBooks:
    """Completion (model) tokens of the groups that reached the queue, and of those it dropped, by reason."""

    tokens: int = 0  # tokens of every group that reached the queue
    rollouts: int = 0  # rollouts of those groups
    dropped_tokens: Counter[DropReason] = field(default_factory=Counter)

    def generated(self, group: RolloutGroup) -> None:
        self.tokens += group.num_tokens
        self.rollouts += len(group.rollouts)

    def dropped(self, reason: DropReason, groups: Iterable[RolloutGroup]) -> None:
        self.dropped_tokens[reason] += sum(g.num_tokens for g in groups)

    def metrics(self) -> dict[str, float]:
        out = {"tokens/generated": self.tokens,
               "length/generated_mean": self.tokens / self.rollouts if self.rollouts else 0.0}
        out.update({f"tokens/dropped_{r.value}": t for r, t in self.dropped_tokens.items()})
        return out


HISTOGRAM_BUCKETS = 9  # groups 0..7 versions old each have a gauge, older ones share "8plus"


def trained_gauges(batch: Iterable[RolloutGroup], staleness: Iterable[int], max_staleness: int) -> dict[str, float]:
    """A batch's ``length/trained_mean`` and its groups by staleness: ``staleness/groups_s0``... up to the bound,
    and beyond it if any, with everything 8 or more versions old in ``staleness/groups_s8plus`` (a fixed number
    of gauges per step whatever the bound: the engine-limit bench sets it to a million)."""
    groups = list(batch)
    rollouts = sum(len(g.rollouts) for g in groups)
    out: dict[str, float] = {"length/trained_mean": sum(g.num_tokens for g in groups) / rollouts if rollouts else 0.0}
    last = HISTOGRAM_BUCKETS - 1
    by_staleness = Counter(min(s, last) for s in staleness)
    for s in range(min(max(max_staleness, *by_staleness, 0), last) + 1):
        out[f"staleness/groups_s{s}" if s < last else f"staleness/groups_s{last}plus"] = by_staleness.get(s, 0)
    return out
