"""Scoring a group's samples with a user's function (a reward, a judge), without ever stalling the event loop.

An ``async`` reward runs on the event loop. A synchronous one runs in a worker thread (anyio's
``to_thread.run_sync`` under a ``CapacityLimiter`` of ``ProducerConfig.reward_threads``), one thread call per
group, unless ``ProducerConfig.sync_rewards`` says it is cheap enough to run inline. Every call is bounded by
``reward_timeout_s``; a group whose scoring times out is dropped and counted (``reward_timeout``).

A thread cannot be stopped: a timed-out synchronous call keeps running until it returns, and its limiter slot
goes to the next group. So that hung calls cannot pile up threads without end, once ``reward_threads`` calls
are overrunning at the same time the run stops with ``NoProgressError``.

The limits come with each call (the ``ProducerConfig`` of the group's request), so one scorer serves a pipeline's
producers and its evaluator alike. The same machinery runs a preference trainer's pairwise judge
(``asyncrl.preference.groups``) and an agent's reward: ``run_calls`` takes a group's calls as argument tuples, and
``ScoringKind`` names the function and the reasons its group is dropped under.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import time
from dataclasses import dataclass
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread

from asyncrl.aio import together
from asyncrl.config import ProducerConfig, RewardExecution
from asyncrl.errors import NoProgressError, RolloutDropped
from asyncrl.types import DropReason, Prompt, Sample

RewardFn = Callable[[Prompt, Sample], "float | Awaitable[float]"]


class RewardRejected(RolloutDropped):
    """A group's scoring failed in a way that drops the group (``reason`` says how)."""


@dataclass(frozen=True, slots=True)
class ScoringKind:
    """What is scoring (for messages) and the reasons a group is dropped under when it fails."""

    noun: str
    error: DropReason
    invalid: DropReason
    timeout: DropReason


REWARD = ScoringKind("reward function", DropReason.REWARD_ERROR, DropReason.REWARD_INVALID, DropReason.REWARD_TIMEOUT)


class RewardScorer:
    """Scores groups with one reward function (shared by every in-flight group of its maker); with another
    ``kind``, runs any function's calls the same way (``run_calls``)."""

    def __init__(self, fn: Callable[..., Any], *, kind: ScoringKind = REWARD) -> None:
        self._fn = fn
        self._kind = kind
        self._is_async = is_async_callable(fn)
        # Sized by each call's ``reward_threads`` (one pipeline's calls all carry the same).
        self._limiter = anyio.CapacityLimiter(1)
        self._overrunning = 0  # timed-out thread calls still running
        self._lock = threading.Lock()  # guards _overrunning (decremented from worker threads)

    @property
    def overrunning(self) -> int:
        """Synchronous calls that timed out and are still running in their threads."""
        return self._overrunning

    async def score(self, prompt: Prompt, samples: Sequence[Sample], config: ProducerConfig) -> list[float]:
        """One reward per sample, under ``config``'s limits. Raises ``RewardRejected`` (the group is dropped) or
        ``NoProgressError``."""
        return [self.checked(v) for v in await self.run_calls([(prompt, s) for s in samples], config)]

    async def run_calls(self, calls: Sequence[tuple[Any, ...]], config: ProducerConfig) -> list[Any]:
        """``fn(*args)`` for every ``args`` in ``calls`` (one group's), as ``config`` says (``sync_rewards``):
        inline, in a worker thread (one thread call for them all) or concurrently on the loop, bounded together by
        ``reward_timeout_s``. Raises ``RewardRejected`` under the kind's reasons, or ``NoProgressError``."""
        timeout_s = config.reward_timeout_s
        if not (self._is_async or config.sync_rewards is RewardExecution.THREAD):
            return self._inline(calls, timeout_s)
        if self._overrunning >= config.reward_threads:
            raise NoProgressError(f"the {self._kind.noun} hangs: {self._overrunning} calls are still running "
                                  f"more than reward_timeout_s={timeout_s}s after they started")
        self._limiter.total_tokens = config.reward_threads
        try:
            async with asyncio.timeout(timeout_s):
                return await self._call(calls)
        except TimeoutError:
            raise RewardRejected(self._kind.timeout,
                                 f"{self._kind.noun} took longer than reward_timeout_s={timeout_s}s") from None
        except (asyncio.CancelledError, NoProgressError):
            raise
        except Exception as exc:
            raise RewardRejected(self._kind.error, f"{self._kind.noun} raised {exc!r}") from exc

    def _inline(self, calls: Sequence[tuple[Any, ...]], timeout_s: float) -> list[Any]:
        """``sync_rewards="inline"``: called on the event loop, where nothing can interrupt it, so the timeout is
        checked once it returns (without an ``asyncio.timeout`` per group: this path exists to be cheap)."""
        t0 = time.perf_counter()
        try:
            values = [self._fn(*args) for args in calls]
        except Exception as exc:
            raise RewardRejected(self._kind.error, f"{self._kind.noun} raised {exc!r}") from exc
        if time.perf_counter() - t0 > timeout_s:
            raise RewardRejected(self._kind.timeout, f"inline {self._kind.noun} took longer than "
                                                     f"reward_timeout_s={timeout_s}s")
        if any(type(v) is not float and inspect.isawaitable(v) for v in values):
            for v in values:
                if inspect.isawaitable(v):
                    v.close()  # type: ignore[attr-defined]
            raise RewardRejected(self._kind.error, f"an inline {self._kind.noun} returned an awaitable; "
                                                   "make it async (it then runs on the loop, timed)")
        return values

    async def _call(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        if self._is_async:  # the group's calls run concurrently (a judge model, a sandbox...)
            return await together(*(self._fn(*args) for args in calls))
        values = await self._in_worker_thread(calls)
        if any(type(v) is not float and inspect.isawaitable(v) for v in values):  # a sync fn returning awaitables
            return await together(*(_as_awaitable(v) for v in values))
        return values

    async def _in_worker_thread(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        call = _ThreadCall(self, calls)
        try:
            return await anyio.to_thread.run_sync(call.run, abandon_on_cancel=True, limiter=self._limiter)
        except BaseException:
            call.abandon()
            raise

    def checked(self, value: object) -> float:
        """``value`` as a finite float; else ``RewardRejected`` under the kind's ``invalid`` reason."""
        if type(value) is float and math.isfinite(value):  # the usual case, without the ABC checks below
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardRejected(self._kind.invalid, f"{self._kind.noun} returned {value!r}, not a finite number")
        return float(value)

    def _overrun(self, delta: int) -> None:
        with self._lock:
            self._overrunning += delta


class _ThreadCall:
    """One group's synchronous scoring in a worker thread; counts itself while it overruns its timeout."""

    def __init__(self, scorer: RewardScorer, calls: Sequence[tuple[Any, ...]]) -> None:
        self._scorer, self._calls = scorer, calls
        self._lock = threading.Lock()
        self._running = True
        self._abandoned = False

    def run(self) -> list[Any]:
        try:
            return [self._scorer._fn(*args) for args in self._calls]
        finally:
            with self._lock:
                self._running = False
                if self._abandoned:
                    self._scorer._overrun(-1)

    def abandon(self) -> None:
        with self._lock:
            if self._running and not self._abandoned:
                self._abandoned = True
                self._scorer._overrun(+1)


async def _as_awaitable(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
