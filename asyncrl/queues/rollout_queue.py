"""The bounded rollout queue between producers and the learner.

Producers ``await put(group)`` and wait while it is full (backpressure; memory is bounded by ``capacity``
groups). The learner ``await get_batch(k, version)``; groups staler than ``max_staleness`` are dropped at
that moment, counted, and never reach the loss.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from asyncrl.config import QueueConfig
from asyncrl.ledger import GroupLedger
from asyncrl.types import DropReason, RolloutGroup


SEEN_IDS_LIMIT = 10_000  # group ids remembered for de-duplication (retries come within seconds)


class QueueClosed(Exception):
    """The queue was closed: no more groups will come (``get_batch``) or be accepted (``put``)."""


def is_fresh(group: RolloutGroup, current_version: int, max_staleness: int) -> bool:
    """The staleness rule: a group may be trained on iff its oldest token is at most ``max_staleness``
    versions behind the learner's current version."""
    return _fresh(group.staleness(current_version), max_staleness)


def _fresh(staleness: int, max_staleness: int) -> bool:
    """The rule itself, for a staleness already computed (the queue needs it for its histogram too)."""
    return staleness <= max_staleness


@dataclass(slots=True)
class QueueStats:
    """Gauges of one queue (seconds for times)."""

    max_depth: int = 0  # highest depth ever seen (never above capacity)
    put_wait_s: float = 0.0  # total time producers spent blocked on a full queue
    get_wait_s: float = 0.0  # total time the learner spent waiting for groups
    puts_blocked: int = 0  # puts that had to wait for room
    staleness_trained: Counter[int] = field(default_factory=Counter)  # staleness -> groups handed out
    age_s_sum: float = 0.0  # total enqueue-to-dequeue time of handed-out groups
    handed_out: int = 0


class _Waiters:
    """Tasks parked until the queue changes: ``asyncio.Condition`` without its lock.

    The queue's state only changes between awaits on one event loop, so a lock would guard nothing; it
    would only cost an acquire and release per put and per get. Waking is free when nobody waits, which is
    the common case on the hot path. Every waiter is woken and re-checks its own condition, so a waiter
    cancelled after being woken cannot swallow a wake-up another one needed.
    """

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        """Return after the next ``notify_all`` (callers loop until their condition holds)."""
        future = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future in self._futures:  # not woken yet: forget it
                self._futures.remove(future)
            raise

    def notify_all(self) -> None:
        if self._futures:
            futures, self._futures = self._futures, []
            for future in futures:
                if not future.done():
                    future.set_result(None)


class RolloutQueue:
    """Bounded FIFO of rollout groups with the staleness rule applied on the way out."""

    def __init__(self, config: QueueConfig, ledger: GroupLedger | None = None) -> None:
        self.config = config
        self.ledger = ledger or GroupLedger()
        self.stats = QueueStats()
        self._items: deque[RolloutGroup] = deque()
        self._room = _Waiters()  # puts waiting for the queue to have room (or close)
        self._arrivals = _Waiters()  # get_batch waiting for groups (or close / finish)
        self._closed = False
        self._finished = False  # producers are done: the learner drains what is left, then stops
        # Recently accepted group ids, so a retried put is stored once (bounded: retries come soon).
        self._seen_ids: OrderedDict[str, None] = OrderedDict()

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._seen_ids

    async def put(self, group: RolloutGroup) -> bool:
        """Add a group, waiting while the queue is full. Returns False if its id was already accepted."""
        if group.group_id in self._seen_ids:
            return False
        if self._full():
            await self._wait_for_room()
            if group.group_id in self._seen_ids:  # a retry of this group was stored while we waited
                return False
        if self._closed:
            raise QueueClosed("queue closed while putting")
        self._accept(group)  # no await since the checks: nothing can have changed in between
        return True

    def _full(self) -> bool:
        return len(self._items) >= self.config.capacity and not self._closed

    async def _wait_for_room(self) -> None:
        self.stats.puts_blocked += 1
        t0 = time.monotonic()
        while self._full():
            await self._room.wait()
        self.stats.put_wait_s += time.monotonic() - t0

    def _accept(self, group: RolloutGroup) -> None:
        self._seen_ids[group.group_id] = None
        if len(self._seen_ids) > SEEN_IDS_LIMIT:
            self._seen_ids.popitem(last=False)
        self._items.append(group.stamped(time.monotonic()))
        self.ledger.queued += 1
        if len(self._items) > self.stats.max_depth:
            self.stats.max_depth = len(self._items)
        self._arrivals.notify_all()

    async def get_batch(self, size: int, current_version: int) -> list[RolloutGroup]:
        """Take ``size`` fresh groups (FIFO), dropping stale ones on the way. Waits until they exist."""
        batch: list[RolloutGroup] = []
        t0 = time.monotonic()
        try:
            await self._fill(batch, size, current_version)
        except asyncio.CancelledError:
            self.ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, len(batch), queued=True)
            raise
        self.stats.get_wait_s += time.monotonic() - t0
        return batch

    async def _fill(self, batch: list[RolloutGroup], size: int, current_version: int) -> None:
        while len(batch) < size:
            while not (self._items or self._closed or self._finished):
                await self._arrivals.wait()
            if not self._items:
                # Groups taken for this unfinished batch are not trained: count them.
                self.ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, len(batch), queued=True)
                raise QueueClosed(f"no more groups: {len(batch)} of {size} for the batch")
            while self._items and len(batch) < size:  # take what is there, then wake blocked puts once
                self._hand_out(self._items.popleft(), current_version, batch)
            self._room.notify_all()

    def _hand_out(self, group: RolloutGroup, current_version: int, batch: list[RolloutGroup]) -> None:
        staleness = group.staleness(current_version)  # once: both the rule and the histogram need it
        if not _fresh(staleness, self.config.max_staleness):
            self.ledger.drop(DropReason.STALE, queued=True)
            return
        self.stats.staleness_trained[staleness] += 1
        self.stats.age_s_sum += time.monotonic() - group.created_at
        self.stats.handed_out += 1
        batch.append(group)

    async def drop_stale(self, current_version: int) -> int:
        """Drop queued groups already too stale to train on (a saving; get_batch enforces it anyway)."""
        keep = [g for g in self._items if is_fresh(g, current_version, self.config.max_staleness)]
        dropped = len(self._items) - len(keep)
        if dropped:
            self._items = deque(keep)
            self.ledger.drop(DropReason.STALE, dropped, queued=True)
            self._room.notify_all()
        return dropped

    async def finish(self) -> None:
        """No more groups will come: the learner takes what is queued, then ``get_batch`` raises."""
        self._finished = True
        self._arrivals.notify_all()

    async def close(self) -> None:
        """Refuse further puts, wake every waiter, and count what is left as unused."""
        self._closed = True
        if self._items:
            self.ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, len(self._items), queued=True)
            self._items.clear()
        self._room.notify_all()
        self._arrivals.notify_all()

    def metrics(self) -> dict[str, float]:
        handed = self.stats.handed_out
        stale_sum = sum(s * c for s, c in self.stats.staleness_trained.items())
        out = {
            "queue/depth": len(self._items), "queue/capacity": self.config.capacity,
            "queue/max_depth": self.stats.max_depth, "queue/put_wait_s": self.stats.put_wait_s,
            "queue/get_wait_s": self.stats.get_wait_s, "queue/puts_blocked": self.stats.puts_blocked,
            "queue/age_s_mean": self.stats.age_s_sum / handed if handed else 0.0,
            "rollout/staleness_mean": stale_sum / handed if handed else 0.0,
            "rollout/staleness_max": max(self.stats.staleness_trained, default=0),
        }
        for s, c in sorted(self.stats.staleness_trained.items()):
            out[f"rollout/staleness_hist_{s}"] = c
        return out
