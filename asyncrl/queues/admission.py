"""Staleness-aware admission: a producer starts a group only if the group can still be trained within
``QueueConfig.max_staleness`` when it finishes, and the queue hands groups to the learner in start order.

The rule (``admits``). Let ``K = batch_groups * sync.every`` be the groups the learner consumes per version, ``p0``
the policy version when the first group was admitted, ``offset`` the groups of the learner's current publication
cycle it had consumed before that (``(step % every) * batch_groups`` for a resumed run), ``s`` the version the
engines serve now, and ``N`` the groups admitted so far that were not withdrawn (dropped before reaching a batch).
The next group may start iff ``N + offset < (s - p0 + max_staleness + 1) * K``.

Why it holds. Groups reach batches in ticket order (the queue holds a group that finished before an earlier one
started), so the group admitted with ``N`` groups ahead is at position ``i <= N`` of the learner's stream. Batches
are full and a version is published after every ``K`` groups, so position ``i`` is trained at policy ``p0 + (i +
offset) // K``. Its oldest token was sampled at a version ``>= s`` (versions never go back), so its staleness is at
most ``p0 + (i + offset) // K - s <= max_staleness`` exactly when the rule admitted it. The rule never starves the
learner: the groups it needs for the next publication, ``(s - p0 + 1) * K - offset``, are always admissible. Memory
stays bounded as well: at most ``limit`` groups are started and not yet handed to the learner (``grpo_pipeline``:
the queue's capacity plus every producer's in-flight slots), so a large ``max_staleness`` cannot make the queue
hold an unbounded number of finished groups. It assumes only the learner publishes while the gate is in use; a
group that still ends up too stale (a publication from elsewhere, producers outside the gate sharing the queue) is
dropped where the learner consumes, and counted, as without the gate.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from asyncrl.errors import QueueClosed
from asyncrl.versions import VersionClock

__all__ = ["OPEN", "Admission", "AdmissionGate", "OpenAdmission", "admits"]


def admits(admitted: int, served: int, origin: int, max_staleness: int, per_version: int, offset: int = 0) -> bool:
    """The admission rule (see the module docstring): may one more group start, with ``admitted`` groups
    admitted and not withdrawn, the engines serving ``served``, and the gate's origin version ``origin``?"""
    return admitted + offset < (served - origin + max_staleness + 1) * per_version


class Admission(Protocol):
    """What a producer asks before starting a group. Tickets say the group's place in start order."""

    async def admit(self) -> int | None:
        """Wait until one more group may start; its ticket (None: not ordered). Raises ``QueueClosed``."""
        ...

    def withdraw(self, ticket: int | None) -> None:
        """The group of ``ticket`` will never reach the queue (dropped or cut short): its place goes to the next."""
        ...


class OpenAdmission:
    """No gate: every group may start at once, unordered (the documented default of a ``Producer``)."""

    async def admit(self) -> None:
        return None

    def withdraw(self, ticket: int | None) -> None:
        pass


OPEN = OpenAdmission()


class AdmissionGate:
    """The ``admits`` rule as a waiter shared by every producer of a pipeline, and the start order of tickets.

    Waiters are served first come, first served. They wake when the served version moves (a clock observer) or a
    ticket is withdrawn; never by polling. A waiter cancelled after being granted a ticket hands it on to the next
    one (as anyio's ``Condition.wait``), so a cancellation never loses a place. The queue asks ``next_due`` (the
    lowest ticket neither released to the learner nor withdrawn) and ``release``s tickets in that order."""

    def __init__(self, clock: VersionClock, max_staleness: int, per_version: int, offset: int = 0,
                 limit: int | None = None) -> None:
        if per_version <= 0 or not 0 <= offset < per_version or max_staleness < 0 or (limit is not None and limit <= 0):
            raise ValueError(f"per_version {per_version} > 0, 0 <= offset {offset} < per_version, "
                             f"max_staleness {max_staleness} >= 0 and limit {limit} > 0 (or None) are needed")
        self.limit = limit  # groups started and not yet handed to the learner, at most (None: the window alone)
        self._outstanding: set[int] = set()  # tickets issued, neither withdrawn nor handed out
        self.clock = clock
        self.max_staleness = max_staleness
        self.per_version = per_version
        self.offset = offset
        self.origin: int | None = None  # the policy version at the first admission
        self.admitted = 0  # tickets issued and not withdrawn (N)
        self.issued = 0  # tickets issued (the next ticket)
        self.withdrawn = 0
        self.waits = 0  # admissions that had to wait
        self.next_due = 0  # lowest ticket neither released nor withdrawn (== issued: none open)
        self._done: set[int] = set()  # tickets above next_due already released or withdrawn
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._closed = False
        self._listeners: list[Callable[[], None]] = []  # called when next_due moves
        self._unsubscribe = clock.observe(lambda _: self._grant())

    def open_now(self) -> bool:
        """Whether one more group may start right now."""
        origin = self.clock.policy if self.origin is None else self.origin
        if self.limit is not None and len(self._outstanding) >= self.limit:
            return False
        return admits(self.admitted, self.clock.served, origin, self.max_staleness, self.per_version, self.offset)

    async def admit(self) -> int:
        if self._closed:
            raise QueueClosed("the admission gate is closed")
        if not self._waiters and self.open_now():
            return self._issue()
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self.waits += 1
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.withdraw(future.result())  # granted, then cancelled: the place goes to the next waiter
            elif future in self._waiters:
                self._waiters.remove(future)
            raise

    def withdraw(self, ticket: int | None) -> None:
        """The group of ``ticket`` will take no place in a batch (dropped anywhere, or never sent)."""
        if ticket is None:
            return
        self.admitted -= 1
        self.withdrawn += 1
        self._outstanding.discard(ticket)
        self._settle(ticket)
        self._grant()

    def handed_out(self, ticket: int | None) -> None:
        """The group of ``ticket`` left the queue for the learner: it no longer counts against ``limit``."""
        if ticket is not None and ticket in self._outstanding:
            self._outstanding.remove(ticket)
            self._grant()

    def release(self, ticket: int) -> None:
        """The group of ``ticket`` went to the learner's side of the queue, in order (it keeps its place)."""
        self._settle(ticket)

    def observe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` whenever ``next_due`` moves; returns a function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def close(self) -> None:
        """Wake every waiter with ``QueueClosed``; later admissions raise it too. Idempotent."""
        self._closed = True
        self._unsubscribe()
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_exception(QueueClosed("the admission gate is closed"))

    def _issue(self) -> int:
        if self.origin is None:
            self.origin = self.clock.policy
        ticket, self.issued, self.admitted = self.issued, self.issued + 1, self.admitted + 1
        self._outstanding.add(ticket)
        return ticket

    def _grant(self) -> None:
        while self._waiters and not self._closed and self.open_now():
            future = self._waiters.popleft()
            if not future.done():  # a waiter cancelled before its turn is already done: skip it
                future.set_result(self._issue())

    def _settle(self, ticket: int) -> None:
        if ticket < self.next_due or ticket in self._done or ticket >= self.issued:
            return  # settled already (a stale drop after the release), or never issued
        self._done.add(ticket)
        moved = False
        while self.next_due in self._done:
            self._done.remove(self.next_due)
            self.next_due += 1
            moved = True
        if moved:
            for listener in list(self._listeners):
                listener()

    def metrics(self) -> dict[str, float]:
        return {"admission/admitted": self.admitted, "admission/withdrawn": self.withdrawn,
                "admission/waiting": len(self._waiters), "admission/outstanding": len(self._outstanding),
                "admission/waits": self.waits,
                "admission/open": float(self.open_now())}
