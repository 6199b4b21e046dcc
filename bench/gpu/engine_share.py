"""Where the engine's share of one GPU goes during a run: its generation rate before the learner's first step,
while the learner trains, and between the learner's steps, each beside the engine alone.

vLLM's front end counts every generated token (the Prometheus counter ``vllm:generation_tokens``, kept in this
process, updated as each engine step's outputs arrive); ``TokenClock`` samples it, and ``split`` cuts the samples
by the learner's step windows. On one GPU the engine and the learner are two processes sharing it by time slices,
so a rate that falls while the learner trains is contention, and one below the engine alone while the learner
waits is the producers' concurrency (groups held back by the staleness bound, the tail of long answers). The clock
also samples the gauge of requests the engine is running (``vllm:num_requests_running``), which tells the two
apart: fewer requests than the engine alone ran is concurrency, as many at a lower rate is contention."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Sequence
from typing import Any

COUNTER = "vllm:generation_tokens"
RUNNING = "vllm:num_requests_running"


def engine_gauges() -> tuple[float, float] | None:
    """The front end's generated-token counter and its running-request gauge, each summed over engines and labels,
    from one snapshot; None where vLLM keeps no counter (its stats turned off)."""
    from vllm.v1.metrics.reader import Counter, Gauge, get_metrics_snapshot

    metrics = get_metrics_snapshot()
    tokens = [m.value for m in metrics if isinstance(m, Counter) and m.name == COUNTER]
    running = [m.value for m in metrics if isinstance(m, Gauge) and m.name == RUNNING]
    return (sum(tokens), sum(running)) if tokens else None


class TokenClock:
    """Samples ``engine_gauges()`` every ``period_s`` while open: ``samples`` holds (seconds since ``t0``, tokens
    since opening, requests running)."""

    def __init__(self, t0: float, period_s: float = 0.5) -> None:
        self.t0, self.period_s = t0, period_s
        self.samples: list[tuple[float, float, float]] = []
        self._base: float | None = None
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        gauges = engine_gauges()
        if gauges is None:
            return
        total, running = gauges
        if self._base is None:
            self._base = total
        self.samples.append((time.perf_counter() - self.t0, total - self._base, running))

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


# (seconds, tokens[, running]): tuples as sampled, lists as a result file keeps them (files written before the gauge
# was sampled hold pairs).
Samples = Sequence[Sequence[float]]


def running_mean(samples: Samples, spans: Sequence[tuple[float, float]] | None = None) -> float | None:
    """The mean of the running-request gauge over the samples inside ``spans``, each ``[start, end)`` (None: every
    sample; the clock samples at a steady period, so a plain mean is a time average); None where no sample inside
    holds the gauge."""
    inside = [s[2] for s in samples if len(s) > 2 and (spans is None or any(a <= s[0] < b for a, b in spans))]
    return sum(inside) / len(inside) if inside else None


def tokens_at(samples: Samples, t: float) -> float:
    """The counter at ``t``, linear between samples (flat outside them)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, c0), (t1, c1) = samples[i - 1][:2], samples[i][:2]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def split(samples: Samples, step_ends: list[float], step_s: list[float],
          alone_tokens_per_s: float | None = None) -> dict[str, Any] | None:
    """The engine's tokens and seconds in three phases: ``fill`` (before the learner's first step began),
    ``training`` (inside a learner step: ``[end - step_s, end]``) and ``between`` (after the first step began,
    outside the steps, until the last step ended); with each phase's tokens/s, its mean running requests where
    sampled, and, given the engine alone's rate, its share of that. None with fewer than two samples or no step."""
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
        if (running := running_mean(samples, spans)) is not None:
            out[name]["running"] = running
        if rate is not None and alone_tokens_per_s:
            out[name]["of_alone"] = rate / alone_tokens_per_s
    out["span_s"] = last - start
    out["tokens"] = tokens_at(samples, last) - tokens_at(samples, start)
    return out
