"""The bounded rollout queue between producers and the learner, as a sending end and a receiving end.

``senders, receiver = create_rollout_queue(config, clock)``. Producers ``await sender.send(group)`` and wait while the
queue is full (backpressure: memory is bounded by ``capacity`` groups); each producer holds its own
``sender.clone()``. The learner ``await receiver.receive_batch(k)``. Closing works as in anyio's memory object
streams:

- when every sending end is closed, the receiver hands out what is queued and then raises ``EndOfRollouts``;
- when the receiving end is closed, every ``send`` (waiting or new) raises ``QueueClosed``, and what was queued
  is counted as unused.

Staleness is enforced where the learner consumes: a group more than ``max_staleness`` versions behind the
clock's ``policy`` version is dropped, counted, and never reaches the loss. The queue also learns of every
version change from the ``VersionClock`` and drops queued groups that just became too stale, so their room
goes back to the producers at once.

With an ``AdmissionGate`` (``asyncrl.queues.admission``) groups are sent with admission tickets (kept in the queue's
own envelope, ``_Queued``, never on the message), and the learner gets
them in ticket (start) order: a group that finished before an earlier-started one is held until that one arrives
or is withdrawn. Held groups are bounded by the gate (its window and ``limit``), not by ``capacity``, and a ticketed
send never waits. Groups without a ticket (remote producers, synchronous mode) are released on arrival.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from asyncrl.config import QueueConfig
from asyncrl.counters import Drops
from asyncrl.errors import EndOfRollouts, QueueClosed
from asyncrl.queues.admission import AdmissionGate
from asyncrl.queues.lengths import TokenBooks
from asyncrl.types import DropReason, RolloutGroup
from asyncrl.versions import VersionClock

SEEN_IDS_LIMIT = 10_000  # group ids remembered for de-duplication (retries come within seconds)


def is_fresh(group: RolloutGroup, policy_version: int, max_staleness: int) -> bool:
    """The staleness rule: a group may be trained on iff its oldest token is at most ``max_staleness``
    versions behind the learner's policy version."""
    return group.staleness(policy_version) <= max_staleness


class QueueStatistics(NamedTuple):
    """A snapshot of one rollout queue (times in seconds)."""

    depth: int  # groups queued now (held for an earlier ticket included)
    capacity: int
    open_senders: int  # sending ends not closed yet
    waiting_senders: int  # sends blocked on a full queue right now
    receiver_closed: bool
    max_depth: int  # most groups ever released to the learner's side at once (never above capacity)
    sends_blocked: int  # sends that had to wait for room
    send_wait_s: float  # total time sends spent blocked on a full queue
    receive_wait_s: float  # total time the receiver spent waiting for groups
    handed_out: int  # groups given to the learner
    age_s_sum: float  # total enqueue-to-hand-out time of those groups
    staleness: dict[int, int]  # staleness -> groups handed out


@dataclass(slots=True)
class QueueCounters:
    """A queue's books, written by it alone. ``entered == handed_out + dropped + depth`` whenever no
    ``receive_batch`` is part-way through a batch."""

    entered: int = 0  # groups stored (a duplicate id is not)
    handed_out: int = 0  # groups ``receive_batch`` returned to the learner
    dropped: Drops = field(default_factory=Drops)  # groups dropped inside: stale, or unused at close, by reason


class _Waiters:
    """Tasks parked until the queue changes: ``asyncio.Condition`` without its lock.

    The queue's state only changes between awaits on one event loop, so a lock would guard nothing. Every
    waiter is woken and re-checks its own condition, so one cancelled after being woken cannot swallow a
    wake-up another one needed."""

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._futures)

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        finally:
            if future in self._futures:  # cancelled before being woken: forget it
                self._futures.remove(future)

    def notify_all(self) -> None:
        if self._futures:
            futures, self._futures = self._futures, []
            for future in futures:
                if not future.done():
                    future.set_result(None)


DropObserver = Callable[[DropReason, Sequence[RolloutGroup]], None]  # told of the groups the queue drops, on the loop


@dataclass(slots=True)
class _Queued:
    """A group in the queue, in its envelope (not frozen: a frozen dataclass costs 0.5 us more per group, on the
    queue's hot path)."""

    arrived: float  # time.monotonic() when it was accepted
    group: RolloutGroup
    ticket: int | None  # its admission ticket (None: not gated)


class _State:
    """What both ends share."""

    def __init__(self, config: QueueConfig, clock: VersionClock, gate: AdmissionGate | None = None) -> None:
        self.config = config
        self.gate = gate
        self.held: dict[int, _Queued] = {}  # ticket -> group waiting for an earlier ticket
        self.tokens = TokenBooks()
        self.clock = clock
        self.counters = QueueCounters()
        self.items: deque[_Queued] = deque()
        self.room = _Waiters()  # sends waiting for room
        self.arrivals = _Waiters()  # the receiver waiting for groups or for the senders to close
        self.seen_ids: OrderedDict[str, None] = OrderedDict()  # accepted ids: a retried send is stored once
        self.open_senders = 0
        self.receiver_closed = False
        self.max_depth = 0
        self.sends_blocked = 0
        self.send_wait_s = 0.0
        self.receive_wait_s = 0.0
        self.age_s_sum = 0.0
        self.staleness: Counter[int] = Counter()
        self.drop_observers: list[DropObserver] = []
        self.unsubscribe = clock.observe(self.on_version)
        self.unsubscribe_gate = gate.observe(self.release_due) if gate is not None else lambda: None

    def full(self) -> bool:
        return len(self.items) >= self.config.capacity and not self.receiver_closed

    def accept(self, group: RolloutGroup, ticket: int | None) -> None:
        self.seen_ids[group.group_id] = None
        if len(self.seen_ids) > SEEN_IDS_LIMIT:
            self.seen_ids.popitem(last=False)
        self.counters.entered += 1
        self.tokens.generated(group)
        if ticket is not None and self.gate is not None:
            self.held[ticket] = _Queued(time.monotonic(), group, ticket)
            self.release_due()
            return
        self.append(_Queued(time.monotonic(), group, None))

    def append(self, entry: _Queued) -> None:
        self.items.append(entry)
        if len(self.items) > self.max_depth:
            self.max_depth = len(self.items)
        self.arrivals.notify_all()

    def release_due(self) -> None:
        """Move held groups to the learner's side in ticket order, while there is room."""
        gate = self.gate
        while gate is not None and gate.next_due in self.held and not self.full():
            ticket = gate.next_due
            self.append(self.held.pop(ticket))
            gate.release(ticket)

    def drop(self, reason: DropReason, entries: list[_Queued]) -> None:
        """Count queued groups as dropped; their admission places go to the next groups."""
        self.counters.dropped.add(reason, len(entries))
        self.tokens.dropped(reason, [e.group for e in entries])
        for observe in self.drop_observers:
            observe(reason, [e.group for e in entries])
        for e in entries:
            if self.gate is not None:
                self.gate.withdraw(e.ticket)

    def on_version(self, clock: VersionClock) -> None:
        """Drop queued groups that the new policy version made too stale (``receive_batch`` would anyway)."""
        policy, limit = clock.policy, self.config.max_staleness
        keep = deque(e for e in self.items if e.group.staleness(policy) <= limit)
        if len(keep) < len(self.items):
            stale = [e for e in self.items if e.group.staleness(policy) > limit]
            self.items = keep
            self.drop(DropReason.STALE, stale)
            self.release_due()
            self.room.notify_all()

    def close_receiver(self) -> None:
        if self.receiver_closed:
            return
        self.receiver_closed = True
        self.unsubscribe()
        self.unsubscribe_gate()
        if self.gate is not None:
            self.gate.close()  # first: the places that the drops below free go to nobody
        left = [*self.items, *self.held.values()]
        self.items.clear()
        self.held.clear()
        self.drop(DropReason.UNUSED_AT_SHUTDOWN, left)
        self.room.notify_all()
        self.arrivals.notify_all()


class RolloutSender:
    """A sending end. ``clone()`` one per producer; the queue ends once every clone is closed."""

    __slots__ = ("_state", "_closed")

    def __init__(self, state: _State) -> None:
        self._state = state
        self._closed = False
        state.open_senders += 1

    def clone(self) -> RolloutSender:
        if self._closed:
            raise RuntimeError("cannot clone a closed rollout sender")
        return RolloutSender(self._state)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def receiver_closed(self) -> bool:
        """True once the receiving end is closed: every send raises ``QueueClosed`` from then on."""
        return self._state.receiver_closed

    async def send(self, group: RolloutGroup, *, ticket: int | None = None) -> bool:
        """Queue a group, waiting while the queue is full. False if its id was already accepted. ``ticket``: its
        admission ticket (held for earlier tickets, then handed out in ticket order; None: released on arrival).

        Raises ``QueueClosed`` once the receiving end is closed."""
        state = self._state
        if self._closed:
            raise RuntimeError("send on a closed rollout sender")
        if state.receiver_closed:
            raise QueueClosed("the rollout queue's receiver is closed")
        if group.group_id in state.seen_ids:
            return self._refuse(ticket)
        if state.full() and (ticket is None or state.gate is None):  # held groups need no room
            await self._wait_for_room()
            if group.group_id in state.seen_ids:  # a retry of this group was stored while we waited
                return self._refuse(ticket)
        if state.receiver_closed:
            raise QueueClosed("the rollout queue's receiver is closed")
        state.accept(group, ticket)  # no await since the checks: nothing can have changed in between
        return True

    def _refuse(self, ticket: int | None) -> bool:
        if self._state.gate is not None:  # a duplicate takes no place in a batch
            self._state.gate.withdraw(ticket)
        return False

    async def _wait_for_room(self) -> None:
        state = self._state
        state.sends_blocked += 1
        t0 = time.monotonic()
        try:
            while state.full():
                await state.room.wait()
        finally:
            state.send_wait_s += time.monotonic() - t0

    def close(self) -> None:
        """Close this end (idempotent). When the last one closes, the receiver drains and ends."""
        if not self._closed:
            self._closed = True
            self._state.open_senders -= 1
            if self._state.open_senders == 0:
                self._state.arrivals.notify_all()

    async def aclose(self) -> None:
        """``close`` for a ``GroupSink``'s caller (nothing to wait for)."""
        self.close()

    def __enter__(self) -> RolloutSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RolloutReceiver:
    """The receiving end, read by the learner."""

    __slots__ = ("_state",)

    def __init__(self, state: _State) -> None:
        self._state = state

    @property
    def config(self) -> QueueConfig:
        return self._state.config

    @property
    def counters(self) -> QueueCounters:
        """This queue's books (read only: the queue alone writes them)."""
        return self._state.counters

    @property
    def depth(self) -> int:
        """Groups in the queue: released to the learner's side, or held for an earlier ticket."""
        return len(self._state.items) + len(self._state.held)

    @property
    def closed(self) -> bool:
        return self._state.receiver_closed

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._state.seen_ids

    def observe_drops(self, observer: DropObserver) -> Callable[[], None]:
        """Call ``observer(reason, groups)`` whenever the queue drops groups (stale, unused at close); returns the
        function that stops it (the rollout log names dropped groups this way)."""
        self._state.drop_observers.append(observer)
        return lambda: self._state.drop_observers.remove(observer) if observer in self._state.drop_observers else None

    async def receive_batch(self, size: int) -> list[RolloutGroup]:
        """Take ``size`` fresh groups (in ticket order, else FIFO), dropping stale ones on the way; waits until they
        exist.

        Raises ``EndOfRollouts`` once every sender is closed and the queue is empty (groups taken for the
        unfinished batch are counted as unused)."""
        state = self._state
        if state.receiver_closed:
            raise RuntimeError("receive on a closed rollout receiver")
        batch: list[RolloutGroup] = []
        taken: list[tuple[int, float]] = []  # (staleness, time queued) of each group in ``batch``
        t0 = time.monotonic()
        try:
            self._fill(batch, taken, size) if state.items else None
            while len(batch) < size:
                await self._wait_for_groups()
                self._fill(batch, taken, size)
        except BaseException:
            state.counters.dropped.add(DropReason.UNUSED_AT_SHUTDOWN, len(batch))
            raise
        finally:
            state.receive_wait_s += time.monotonic() - t0
        state.counters.handed_out += len(batch)  # only a batch returned is handed out
        for staleness, age_s in taken:
            state.staleness[staleness] += 1
            state.age_s_sum += age_s
        return batch

    async def _wait_for_groups(self) -> None:
        state = self._state
        while not state.items:
            if state.open_senders == 0:
                raise EndOfRollouts("every rollout sender is closed and the queue is empty")
            if state.receiver_closed:
                raise QueueClosed("the rollout queue's receiver was closed")
            await state.arrivals.wait()

    def _fill(self, batch: list[RolloutGroup], taken: list[tuple[int, float]], size: int) -> None:
        """Take what is queued into ``batch``, up to ``size``, then wake blocked sends once."""
        state = self._state
        policy, limit, now = state.clock.policy, state.config.max_staleness, time.monotonic()
        while state.items and len(batch) < size:
            entry = state.items.popleft()
            staleness = entry.group.staleness(policy)
            if staleness > limit:
                state.drop(DropReason.STALE, [entry])
                continue
            taken.append((staleness, now - entry.arrived))
            batch.append(entry.group)
            if state.gate is not None:
                state.gate.handed_out(entry.ticket)
            state.release_due()  # the room just made may let held groups follow in order
        state.room.notify_all()

    def close(self) -> None:
        """Refuse further sends, wake every waiter, and count what is left as unused. Idempotent."""
        self._state.close_receiver()

    def __enter__(self) -> RolloutReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> QueueStatistics:
        s = self._state
        return QueueStatistics(
            depth=len(s.items) + len(s.held), capacity=s.config.capacity, open_senders=s.open_senders,
            waiting_senders=len(s.room), receiver_closed=s.receiver_closed, max_depth=s.max_depth,
            sends_blocked=s.sends_blocked, send_wait_s=s.send_wait_s, receive_wait_s=s.receive_wait_s,
            handed_out=s.counters.handed_out, age_s_sum=s.age_s_sum, staleness=dict(s.staleness))

    def metrics(self) -> dict[str, float]:
        """The statistics as ``queue/*`` and ``rollout/staleness_*`` gauges."""
        st = self.statistics()
        handed = st.handed_out
        out = {
            "queue/depth": st.depth, "queue/capacity": st.capacity, "queue/max_depth": st.max_depth,
            "queue/send_wait_s": st.send_wait_s, "queue/receive_wait_s": st.receive_wait_s,
            "queue/sends_blocked": st.sends_blocked, "queue/open_senders": st.open_senders,
            "queue/age_s_mean": st.age_s_sum / handed if handed else 0.0,
            "rollout/staleness_mean": sum(s * c for s, c in st.staleness.items()) / handed if handed else 0.0,
            "rollout/staleness_max": max(st.staleness, default=0),
        }
        out.update({f"rollout/staleness_hist_{s}": c for s, c in sorted(st.staleness.items())})
        out.update(self._state.tokens.metrics())
        out["queue/held"] = len(self._state.held)
        if self._state.gate is not None:
            out.update(self._state.gate.metrics())
        return out


def create_rollout_queue(config: QueueConfig, clock: VersionClock,
                         gate: AdmissionGate | None = None) -> tuple[RolloutSender, RolloutReceiver]:
    """A new queue's two ends; its books are the receiver's ``counters``. ``gate`` is the producers' admission
    gate, whose tickets set the order groups are handed out in (None: arrival order)."""
    state = _State(config, clock, gate)
    return RolloutSender(state), RolloutReceiver(state)
