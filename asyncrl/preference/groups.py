"""``JudgedGroups``: the group maker of the preference trainers, a group's completions judged in pairs.

Without an opponent (Online DPO) every pair of the group's ``n`` completions is judged once (``n = 2``: one
comparison) and each completion scores its mean win probability against the others: the learner pairs the best
with the worst. With an ``opponent`` sampler (XPO's reference, Nash-MD's mixture) each completion is judged
against one completion the opponent samples for the same prompt, and scores the probability that it wins; the
opponents travel with the group (``RolloutGroup.companions["opponents"]``) when the loss needs them.

A group whose comparisons all tie has no pair to learn from: it is dropped as ``preference_tie`` and counted.
Judge calls run under ``asyncrl.groups.scoring``' machinery (threads, limiter, timeout, counted drops).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncrl.config import ProducerConfig
from asyncrl.engines.protocols import PromptRejected, Sampler
from asyncrl.groups.maker import GroupMaker, GroupRequest, check_prompt, sample_completions
from asyncrl.groups.scoring import RewardRejected, RewardScorer, ScoringKind
from asyncrl.preference.judges import JudgeFn
from asyncrl.types import DropReason, FinishReason, Prompt, Rollout, RolloutGroup, Sample

__all__ = ["JUDGE", "OPPONENTS", "JudgeCounters", "JudgedGroups"]

JUDGE = ScoringKind("pairwise judge", DropReason.JUDGE_ERROR, DropReason.JUDGE_INVALID, DropReason.JUDGE_TIMEOUT)
OPPONENT_RESUBMITS = 2  # an opponent sample cut by an abort pause is sampled again at most this often
OPPONENTS = "opponents"  # the companion role of the opponents' completions (XPO's loss reads them)


@dataclass(slots=True)
class JudgeCounters:
    """The judge's books, written by its scorer alone."""

    groups: int = 0  # groups scored with at least one decisive comparison
    comparisons: int = 0  # judge calls that returned a probability
    ties: int = 0  # comparisons that returned exactly 0.5
    win_prob_sum: float = 0.0  # against an opponent: the summed probability that the policy's completion won
    opponent_judged: int = 0  # ... over this many comparisons
    opponent_samples: int = 0  # completions the opponent sampled
    opponent_s: float = 0.0  # seconds groups spent waiting for the opponent's completions (summed over groups)


class JudgedGroups(GroupMaker):
    """Samples ``n`` completions per prompt and scores them with a pairwise ``judge``, against each other or
    against ``opponent``'s completions; each rollout's reward is its preference score."""

    def __init__(self, judge: JudgeFn, *, opponent: Sampler | None = None, keep_opponents: bool = True) -> None:
        """``keep_opponents``: whether the opponents' completions go with the group (XPO trains on them;
        Nash-MD only needs the verdicts)."""
        self.judge = judge
        self._calls = RewardScorer(judge, kind=JUDGE)
        self.opponent = opponent
        self.keep_opponents = keep_opponents
        self.counters = JudgeCounters()

    @property
    def overrunning(self) -> int:
        return self._calls.overrunning

    async def make(self, request: GroupRequest) -> RolloutGroup:
        check_prompt(request)
        samples = await sample_completions(request)
        scores, opponents = await self.score(request.group_id, request.prompt, samples, request.config)
        rollouts = tuple(Rollout(s, r) for s, r in zip(samples, scores))
        companions = {OPPONENTS: opponents} if opponents else {}
        return RolloutGroup(request.group_id, request.prompt, rollouts, companions=companions)

    def fork(self) -> JudgedGroups:
        return JudgedGroups(self.judge, opponent=self.opponent, keep_opponents=self.keep_opponents)

    async def score(self, group_id: str, prompt: Prompt, samples: Sequence[Sample],
                    config: ProducerConfig) -> tuple[list[float], tuple[Sample, ...]]:
        """Per-sample preference scores in [0, 1], and the opponents' completions (empty without an opponent,
        or when they are not kept), under ``config``'s limits and sampling. Raises ``RewardRejected`` (the group is
        dropped) or ``NoProgressError``."""
        if self.opponent is None:
            return self._round_robin(samples, await self._judged(
                [(prompt, a, b) for a, b in itertools.combinations(samples, 2)], config)), ()
        opponents = await self._opponents(group_id, prompt, len(samples), config)
        probs = await self._judged([(prompt, s, o) for s, o in zip(samples, opponents)], config)
        self.counters.win_prob_sum += sum(probs)
        self.counters.opponent_judged += len(probs)
        self._check_decisive(probs)
        self.counters.groups += 1
        return probs, tuple(opponents) if self.keep_opponents else ()

    def metrics(self) -> dict[str, float]:
        c = self.counters
        out = {"judge/groups": c.groups, "judge/comparisons": c.comparisons, "judge/ties": c.ties,
               "judge/overrunning": self.overrunning}
        if self.opponent is not None:
            out.update({"judge/win_rate": c.win_prob_sum / c.opponent_judged if c.opponent_judged else math.nan,
                        "judge/opponent_samples": c.opponent_samples, "judge/opponent_s": c.opponent_s})
        return out

    async def _judged(self, calls: list[tuple[Prompt, Sample, Sample]], config: ProducerConfig) -> list[float]:
        probs = [_probability(v) for v in await self._calls.run_calls(calls, config)]
        self.counters.comparisons += len(probs)
        self.counters.ties += sum(p == 0.5 for p in probs)
        return probs

    def _round_robin(self, samples: Sequence[Sample], probs: list[float]) -> list[float]:
        n = len(samples)
        if n < 2:
            raise ValueError("pairwise judging within a group needs at least 2 samples (SamplingConfig.n)")
        wins = [0.0] * n
        for (i, j), p in zip(itertools.combinations(range(n), 2), probs):
            wins[i] += p
            wins[j] += 1.0 - p
        scores = [w / (n - 1) for w in wins]
        if max(scores) == min(scores):  # every comparison tied, or the wins went round in a circle
            raise RewardRejected(DropReason.PREFERENCE_TIE, f"the {n} completions scored equally over "
                                                            f"{len(probs)} comparisons")
        self.counters.groups += 1
        return scores

    @staticmethod
    def _check_decisive(probs: list[float]) -> None:
        if all(p == 0.5 for p in probs):
            raise RewardRejected(DropReason.PREFERENCE_TIE, f"all {len(probs)} comparisons with the opponent tied")

    async def _opponents(self, group_id: str, prompt: Prompt, n: int, config: ProducerConfig) -> list[Sample]:
        assert self.opponent is not None
        t0 = time.perf_counter()
        try:
            out = await self.opponent.generate(prompt.token_ids, config.sampling, request_id=f"{group_id}/opponent",
                                               n=n)
            for attempt in range(1, OPPONENT_RESUBMITS + 1):
                cut = [i for i, s in enumerate(out) if s.finish_reason is FinishReason.ABORT]
                if not cut:
                    break
                again = await self.opponent.generate(prompt.token_ids, config.sampling, n=len(cut),
                                                     request_id=f"{group_id}/opponent/r{attempt}")
                for i, s in zip(cut, again):
                    out[i] = s
            else:
                if any(s.finish_reason is FinishReason.ABORT for s in out):
                    raise RewardRejected(DropReason.ABORTED, "the opponent's completions were cut by abort pauses")
        except PromptRejected as exc:
            raise RewardRejected(DropReason.PROMPT_TOO_LONG if exc.too_long else DropReason.ENGINE_ERROR,
                                 f"opponent {self.opponent.name}: {exc}") from exc
        finally:
            self.counters.opponent_s += time.perf_counter() - t0
        self.counters.opponent_samples += len(out)
        return list(out)


def _probability(value: object) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0:
        return float(value)
    raise RewardRejected(DropReason.JUDGE_INVALID, f"pairwise judge returned {value!r}, not a probability in [0, 1]")
