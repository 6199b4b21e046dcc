"""Where the engine's share of one GPU goes during a run: its generation rate before the learner's first step,
while the learner trains, and between the learner's steps, each beside the engine alone.

vLLM's front end counts every generated token (the Prometheus counter ``vllm:generation_tokens``, kept in this
process, updated as each engine step's outputs arrive); ``TokenClock`` samples it, and ``split`` cuts the samples
by the learner's step windows. On one GPU the engine and the learner are two processes sharing it by time slices,
so a rate that falls while the learner trains is contention, and one below the engine alone while the learner
waits is the producers' concurrency (groups held back by the staleness bound, the tail of long answers)."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Sequence
from typing import Any

COUNTER = "vllm:generation_tokens"


def generated_tokens() -> float | None:
    """The front end's generated-token counter, summed over engines and labels; None where vLLM keeps none (its
    stats turned off)."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    found = [m.value for m in get_metrics_snapshot() if isinstance(m, Counter) and m.name == COUNTER]
    return sum(found) if found else None


class TokenClock:
    """Samples ``generated_tokens()`` every ``period_s`` while open: ``samples`` holds (seconds since ``t0``,
    tokens since opening)."""

    def __init__(self, t0: float, period_s: float = 0.5) -> None:
        self.t0, self.period_s = t0, period_s
        self.samples: list[tuple[float, float]] = []
        self._base: float | None = None
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        total = generated_tokens()
        if total is None:
            return
        if self._base is None:
            self._base = total
        self.samples.append((time.perf_counter() - self.t0, total - self._base))

    async def _run(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.period_s)

    async def __aenter__(self) -> TokenClock:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait({self._task})  # unlike awaiting it, lets a cancellation of this task through
        self._sample()


# (seconds, tokens) pairs: tuples as sampled, lists as a result file keeps them.
Samples = Sequence[Sequence[float]]


def tokens_at(samples: Samples, t: float) -> float:
    """The counter at ``t``, linear between samples (flat outside them)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def split(samples: Samples, step_ends: list[float], step_s: list[float],
          alone_tokens_per_s: float | None = None) -> dict[str, Any] | None:
    """The engine's tokens and seconds in three phases: ``fill`` (before the learner's first step began),
    ``training`` (inside a learner step: ``[end - step_s, end]``) and ``between`` (after the first step began,
    outside the steps, until the last step ended); with each phase's tokens/s and, given the engine alone's,
    its share of that. None with fewer than two samples or no step."""
    if len(samples) < 2 or not step_ends:
        return None
    windows = [(max(0.0, end - s), end) for end, s in zip(step_ends, step_s)]
    first, last = windows[0][0], step_ends[-1]
    start = samples[0][0]
    phases = {"fill": [(start, first)], "training": windows,
              "between": [(a[1], b[0]) for a, b in zip(windows, windows[1:]) if b[0] > a[1]]}
    out: dict[str, Any] = {}
    for name, spans in phases.items():
        seconds = sum(b - a for a, b in spans if b > a)
        tokens = sum(tokens_at(samples, b) - tokens_at(samples, a) for a, b in spans if b > a)
        rate = tokens / seconds if seconds > 0 else None
        out[name] = {"s": seconds, "tokens": tokens, "tokens_per_s": rate}
        if rate is not None and alone_tokens_per_s:
            out[name]["of_alone"] = rate / alone_tokens_per_s
    out["span_s"] = last - start
    out["tokens"] = tokens_at(samples, last) - tokens_at(samples, start)
    return out
