"""Shared by the rollout log tests and the script they kill (not fixtures): steps of made-up groups whose content
follows from the step number, so a step read back can be checked whole."""

from __future__ import annotations

from asyncrl.counters import Drops, GroupTotals
from asyncrl.types import (
    DropReason, FinishReason, Prompt, Rollout, RolloutGroup, Sample, Trajectory, VersionSpan,
)


def make_group(step: int, index: int, tokens: int = 8, n: int = 4) -> RolloutGroup:
    """Group ``index`` of step ``step``: spans over two versions, exact float log-probs, a trajectory among them."""
    rollouts = []
    for i in range(n):
        ids = tuple((step * 31 + index * 7 + i + t) % 1000 for t in range(tokens))
        logprobs = tuple(-((step + t) % 13) / 7.0 - i * 1e-9 for t in range(tokens))
        spans = (VersionSpan(step - 1, 0, tokens // 2), VersionSpan(step, tokens // 2, tokens))
        sample = Sample(ids, logprobs, FinishReason.LENGTH, spans, text=f"s{step}g{index}r{i}")
        if i == n - 1:  # a multi-turn trajectory: two environment tokens in the middle
            mask = tuple(0 if t in (2, 3) else 1 for t in range(tokens))
            logprobs = tuple(0.0 if m == 0 else lp for lp, m in zip(logprobs, mask))
            spans = (VersionSpan(step - 1, 0, 2), VersionSpan(step, 4, tokens))
            sample = Trajectory(ids, logprobs, FinishReason.STOP, spans, text="episode", loss_mask=mask)
        rollouts.append(Rollout(sample, reward=(i + step) % 3 / 2))
    prompt = Prompt(f"p{step}-{index}", (1, 2, step % 50 + 3), text="what?", answer={"value": step, "ok": [1, 2]})
    companions = {"opponents": tuple(r.sample for r in rollouts[:1])} if index == 0 else {}
    return RolloutGroup(f"s{step}-g{index}", prompt, tuple(rollouts), meta={"maker": "test", "step": step},
                        companions=companions)


def make_batch(step: int, groups: int = 2, tokens: int = 8) -> list[RolloutGroup]:
    return [make_group(step, i, tokens) for i in range(groups)]


def totals_at(step: int) -> GroupTotals:
    """Books after ``step``: one stale drop per step, and a reward error every third."""
    return GroupTotals(dropped=Drops({DropReason.STALE: step, DropReason.REWARD_ERROR: step // 3}))
