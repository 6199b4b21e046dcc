"""The rollout queue over HTTP, producer side: ``RemoteQueueClient`` is a ``GroupSink`` that sends groups to a
``RolloutIngestServer`` (``ingest_server.py``, whose docstring has the shutdown handshake).

A full remote queue is backpressure, not failure: ``send`` keeps posting again (honouring Retry-After) for as
long as the queue stays full, like ``RolloutSender.send``; cancel it to stop waiting. Connection errors,
timeouts and other 5xx are retried ``max_retries`` times with exponential backoff, then raise
``RemoteQueueError``. After a lost response a group may come back as a duplicate of itself: it is stored once
either way, but ``send`` then returns False.

A client that closes tells the server it will post no more (``/v1/leave``), so a stopping server does not
wait for it. "Queue closed" is final. Once any answer said so, this and every later ``send`` raise ``RemoteQueueClosed``
(also a ``QueueClosed``, so a ``Producer`` stops as it would on a local queue) without posting again, and a
connection error after that is the server going away, not something to retry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp

from asyncrl.errors import ConfigError, QueueClosed
from asyncrl.http.client import JSONClient, Reply, TransportError
from asyncrl.queues.ingest_server import (
    DUPLICATE, GROUPS_PATH, LEAVE_PATH, MAX_PRODUCER_ID, PENDING, PRODUCER_HEADER, QUEUE_CLOSED, QUEUE_FULL, STORED,
)
from asyncrl.queues.wire import group_to_json
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 2.0  # the farewell is a courtesy: a server that does not answer soon is not waited for

__all__ = ["RemoteQueueClient", "RemoteQueueClosed", "RemoteQueueError"]


class RemoteQueueError(Exception):
    """The server refused groups (``status`` 400/401/413/...), or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class RemoteQueueClosed(RemoteQueueError, QueueClosed):
    """The remote queue is closed. Also a ``QueueClosed``, so producers handle both sinks alike."""


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"RemoteQueueClient.{name}", message)


class RemoteQueueClient:
    """A ``GroupSink`` that sends groups to a ``RolloutIngestServer``; one per producer.

    ``producer_id`` names this client to the server (default: a random id), which waits for it to hear
    "queue closed" before it stops. A ``session`` passed in is used as it is and never closed here."""

    def __init__(self, url: str, token: str, *, session: aiohttp.ClientSession | None = None,
                 max_retries: int = 5, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 timeout_s: float = 30.0, max_groups_per_request: int = 64, producer_id: str | None = None) -> None:
        producer_id = producer_id if producer_id is not None else uuid.uuid4().hex
        _check(isinstance(max_retries, int) and not isinstance(max_retries, bool) and max_retries >= 0,
               "max_retries", f"must be an integer >= 0, got {max_retries!r}")
        _check(0 < backoff_s <= max_backoff_s, "backoff_s", "must be in (0, max_backoff_s]")
        _check(isinstance(max_groups_per_request, int) and max_groups_per_request > 0, "max_groups_per_request",
               f"must be a positive integer, got {max_groups_per_request!r}")
        _check(isinstance(producer_id, str) and 0 < len(producer_id) <= MAX_PRODUCER_ID and producer_id.isascii()
               and producer_id.isprintable(), "producer_id",
               f"must be 1-{MAX_PRODUCER_ID} printable ASCII characters, got {producer_id!r}")
        # timeout_s must exceed the server's put_timeout_s, or every wait for room ends as a client timeout.
        self._http = JSONClient(url, token, owner="RemoteQueueClient", timeout_s=timeout_s, session=session,
                                headers={PRODUCER_HEADER: producer_id})
        self.url = self._http.base_url + GROUPS_PATH
        self.producer_id = producer_id
        self._max_retries, self._backoff_s, self._max_backoff_s = max_retries, backoff_s, max_backoff_s
        self._max_groups = max_groups_per_request
        self._queue_closed = False
        self._posted = False  # the server may be waiting for this client to hear "closed"

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}({self.url!r})"

    @property
    def queue_closed(self) -> bool:
        """The server has answered "queue closed": every ``send`` now raises ``RemoteQueueClosed``."""
        return self._queue_closed

    async def send(self, group: RolloutGroup, *, ticket: int | None = None) -> bool:
        """Send one group; True if stored, False if its id was already stored. A remote queue admits no
        producer of another process, so an admission ``ticket`` means nothing here and must be None."""
        if ticket is not None:
            raise ValueError("a RemoteQueueClient takes no admission ticket: a remote producer is not gated")
        return (await self.send_many([group]))[0]

    async def send_many(self, groups: Sequence[RolloutGroup]) -> list[bool]:
        """Send groups in order, ``max_groups_per_request`` per request; one bool per group as ``send``."""
        out: list[bool] = []
        for start in range(0, len(groups), self._max_groups):
            out += await self._ship(groups[start:start + self._max_groups])
        return out

    async def close(self) -> None:
        """Tell the server this producer is leaving (if it ever posted), then close the session. Idempotent."""
        try:
            if self._posted and not self._queue_closed and not self._http.closed:
                self._posted = False
                await self._http.call("POST", LEAVE_PATH, timeout_s=LEAVE_TIMEOUT_S)
        except (TransportError, RuntimeError):  # RuntimeError: a caller's session already closed
            pass
        finally:
            await self._http.close()

    async def aclose(self) -> None:
        """``close``, as a ``GroupSink``."""
        await self.close()

    async def __aenter__(self) -> RemoteQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals

    async def _ship(self, groups: Sequence[RolloutGroup]) -> list[bool]:
        self._raise_if_closed()
        encoded = await asyncio.to_thread(_encode_groups, groups)  # WireError here: our group is bad
        outcome: dict[int, bool] = {}
        pending = list(range(len(groups)))
        failures = 0
        while pending:
            self._raise_if_closed()  # another send of this client may have heard "closed" meanwhile
            reply = await self._post_or_none([encoded[i] for i in pending])
            if reply is not None and "results" in reply.body:
                pending = _apply_results(reply.body["results"], pending, outcome)
            if reply is not None and reply.ok:
                break
            if reply is not None and reply.status == 503 and reply.body.get("reason") == QUEUE_FULL:
                failures = 0  # the server is alive and answering: this is backpressure, wait without limit
                log.debug("remote queue full; %d groups pending", len(pending))
                await asyncio.sleep(reply.retry_after_s if reply.retry_after_s is not None else self._backoff_s)
                continue
            self._raise_if_final(reply)
            failures += 1
            if failures > self._max_retries:
                raise RemoteQueueError(reply.status if reply else None,
                                       f"gave up on {self.url} after {failures} attempts: {_describe(reply)}")
            await asyncio.sleep(self._delay(failures, reply))
        if pending:
            raise RemoteQueueError(200, f"server left {len(pending)} groups unanswered")
        return [outcome[i] for i in range(len(groups))]

    async def _post_or_none(self, encoded: list[bytes]) -> Reply | None:
        """POST the groups; None when the attempt got no answer (worth retrying, unless the queue closed)."""
        body = b'{"groups":[' + b",".join(encoded) + b"]}"
        try:
            reply = await self._http.call("POST", GROUPS_PATH, data=body)
        except TransportError as exc:
            log.warning("remote queue %s unreachable: %s", self.url, exc)
            self._posted = True  # it may have arrived
            return None
        self._posted = self._posted or reply.status != 401  # the server notes a producer once authenticated
        return reply

    def _raise_if_closed(self) -> None:
        if self._queue_closed:
            raise RemoteQueueClosed(None, f"the remote queue at {self.url} is closed")

    def _raise_if_final(self, reply: Reply | None) -> None:
        if reply is not None and reply.body.get("reason") == QUEUE_CLOSED:
            self._queue_closed = True
            raise RemoteQueueClosed(reply.status, reply.error)
        self._raise_if_closed()  # no answer, or a 5xx, once closed: the server is going away
        if reply is None or reply.status >= 500:
            return  # transport error or server trouble: retry
        raise RemoteQueueError(reply.status, reply.error)  # 4xx: the same request would fail again

    def _delay(self, failures: int, reply: Reply | None) -> float:
        delay = min(self._max_backoff_s, self._backoff_s * 2 ** (failures - 1))
        if reply is not None and reply.retry_after_s is not None:
            delay = max(delay, reply.retry_after_s)
        return delay


def _encode_groups(groups: Sequence[RolloutGroup]) -> list[bytes]:
    return [json.dumps(group_to_json(g), separators=(",", ":"), allow_nan=False).encode() for g in groups]


def _apply_results(results: Any, pending: list[int], outcome: dict[int, bool]) -> list[int]:
    """Record stored/duplicate answers; return the indices still to send."""
    if not isinstance(results, list) or len(results) != len(pending) \
            or any(r not in (STORED, DUPLICATE, PENDING) for r in results):
        raise RemoteQueueError(None, f"malformed server reply: results {results!r} for {len(pending)} groups")
    still: list[int] = []
    for index, result in zip(pending, results):
        if result == PENDING:
            still.append(index)
        else:
            outcome[index] = result == STORED
    return still


def _describe(reply: Reply | None) -> str:
    return "connection failed" if reply is None else f"HTTP {reply.status}: {reply.error}"
