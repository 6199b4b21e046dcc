"""The rollout queue over HTTP, learner side: producers in other processes or hosts send groups into it.

``RolloutIngestServer`` holds one sending end of the learner's rollout queue (``create_rollout_queue``) and
feeds it the groups that ``RemoteQueueClient``s (``ingest_client.py``) post. Backpressure crosses the wire:
when the queue stays full for ``put_timeout_s`` the server answers 503 ``queue_full`` + ``Retry-After`` and
the client posts again, so a remote ``send`` waits on a full queue just like a local one. Group ids are
idempotent (the queue stores an id once), which is what makes every retry safe.

Endpoints: ``POST /v1/groups`` (auth) body ``{"groups": [wire group, ...]}``; ``POST /v1/leave`` (auth), a
client saying it will post no more; ``GET /v1/health`` (no auth); ``GET /v1/stats`` (auth). Plain HTTP with
a bearer token: bind to loopback, or put TLS in front.

The shutdown handshake (closing the remote queue ends the remote producers):

1. The learner's last publication has landed or failed (``Learner.run`` returns or raises only then).
2. The learner closes its queue's receiving end. Every post, waiting or new, is now answered 503
   ``queue_closed``, which the client treats as final: its ``send`` raises ``RemoteQueueClosed`` (a
   ``QueueClosed``), and the producer returns. The service that runs it keeps its engine and control routes
   up until then, and until no pause is held, before it closes the engine (``EngineControl.serving``).
3. The learner stops this server (``stop``, or leaving ``async with``). From then on every post is answered
   ``queue_closed`` whether or not the receiver was closed, and, before the port closes, the server waits up
   to ``close_grace_s`` until every producer that posted within ``active_window_s`` has had that answer
   (clients name themselves in the ``X-Asyncrl-Producer`` header; one that closed itself said so with
   ``/v1/leave`` and is not waited for). Then it closes its sending end and the HTTP server. A producer that
   was between two posts therefore hears "queue closed", not "connection refused", and a client that has
   heard it stops retrying connection errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, field_validator

from asyncrl.config_base import NonNegativeFloat, NonNegativeInt, PositiveInt, Seconds, config
from asyncrl.errors import QueueClosed
from asyncrl.http.server import MiB, BearerAuth, HTTPError, bad_request, check_token, json_endpoint, read_body
from asyncrl.queues.rollout_queue import RolloutSender
from asyncrl.queues.wire import WireError, group_from_json
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

GROUPS_PATH = "/v1/groups"
LEAVE_PATH = "/v1/leave"
HEALTH_PATH = "/v1/health"
STATS_PATH = "/v1/stats"
PRODUCER_HEADER = "X-Asyncrl-Producer"  # a client's stable id, so the server knows whom to tell "closed"
MAX_PRODUCER_ID = 128
_FORGET_AT = 1024  # producer ids tracked before the ones gone quiet are pruned

# Per-group outcomes in a response's "results", aligned with the request's groups.
STORED, DUPLICATE, PENDING = "stored", "duplicate", "pending"
# 503 reasons: a full queue is worth retrying, a closed one never is.
QUEUE_FULL, QUEUE_CLOSED = "queue_full", "queue_closed"


@config
class IngestServerConfig:
    """The ingestion server. Validated at construction; errors name the field."""

    token: Annotated[str, Field(description=(
        "shared secret clients send as ``Authorization: Bearer <token>`` (never shown in the repr)"))]
    host: Annotated[str, Field(min_length=1, description=(
        "interface to bind; loopback unless you mean to expose it"))] = "127.0.0.1"
    port: Annotated[int, Field(strict=True, ge=0, le=65535, description=(
        "TCP port; 0 = an ephemeral port (``start()`` returns the real one)"))] = 0
    max_body_bytes: Annotated[PositiveInt, Field(description="request bodies above this get 413")] = 4 * MiB
    put_timeout_s: Annotated[Seconds, Field(description=(
        "how long a request waits for queue room before 503 + Retry-After"))] = 5.0
    max_groups_per_request: Annotated[PositiveInt, Field(description="more groups in one request get 413")] = 64
    retry_after_s: Annotated[NonNegativeInt, Field(description=(
        "Retry-After sent with a queue-full 503 (s); 0 = re-post at once (long poll)"))] = 1
    close_grace_s: Annotated[NonNegativeFloat, Field(description=(
        "how long ``stop`` waits for recent producers to hear 'queue closed': above the longest a producer "
        "spends between two posts (one group's generation and scoring), or a slow one meets 'connection "
        "refused'"))] = 10.0
    active_window_s: Annotated[Seconds, Field(description=(
        "a producer that posted this recently before ``stop`` is waited for"))] = 60.0

    @field_validator("token")
    @classmethod
    def _token(cls, value: str) -> str:
        return check_token("IngestServerConfig.token", value)

    def __repr__(self) -> str:  # never show the token
        return f"IngestServerConfig(host={self.host!r}, port={self.port})"


def _outcome(results: list[str]) -> dict[str, Any]:
    return {"stored": results.count(STORED), "duplicates": results.count(DUPLICATE), "results": results}


class RolloutIngestServer:
    """HTTP front of a rollout queue's sending end: ``async with RolloutIngestServer(sender, cfg) as srv``.

    The server owns ``sender`` from here on and closes it when it stops. ``queue_metrics`` (e.g. the
    receiver's ``metrics``) is shown by ``GET /v1/stats``."""

    def __init__(self, sender: RolloutSender, config: IngestServerConfig, *,
                 queue_metrics: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.sender = sender
        self.config = config
        self.counters: Counter[str] = Counter()  # requests by outcome, groups by fate
        self.url: str | None = None
        self._queue_metrics = queue_metrics
        self._auth = BearerAuth(config.token, "IngestServerConfig.token", "rollout ingest")
        self._runner: web.AppRunner | None = None
        self._queue_closed = False  # a send found the receiver closed
        self._stopping = False
        self._deadlines: set[asyncio.Timeout] = set()  # the put_timeout_s of posts waiting for room
        self._last_post: dict[str, float] = {}  # producer id -> last post (monotonic), until told "closed"
        self._told = asyncio.Event()  # set whenever a producer is told "closed"
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_post(GROUPS_PATH, json_endpoint(self._post_groups, auth=self._auth,
                                                            on_reply=self._count_post))
        self.app.router.add_post(LEAVE_PATH, json_endpoint(self._leave, auth=self._auth, on_reply=self._count_auth))
        self.app.router.add_get(HEALTH_PATH, json_endpoint(self._health))
        self.app.router.add_get(STATS_PATH, json_endpoint(self._stats, auth=self._auth, on_reply=self._count_auth))

    @property
    def closed(self) -> bool:
        """Posts are answered ``queue_closed``: the receiver was seen closed, or the server is stopping."""
        return self._queue_closed or self._stopping

    def unnotified(self) -> list[str]:
        """Producers that posted within ``active_window_s`` and have not been told the queue is closed."""
        now = time.monotonic()
        return sorted(p for p, t in self._last_post.items() if now - t <= self.config.active_window_s)

    async def start(self) -> str:
        """Bind and serve. Returns the base URL with the real port (``http://127.0.0.1:41234``)."""
        if self._runner is not None or self._stopping:
            raise RuntimeError("ingest server already started")
        # In-flight requests wait at most put_timeout_s for room, so shutdown need not wait longer.
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=self.config.put_timeout_s + 1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.config.host, self.config.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        if self.config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("rollout ingest listening on %s (not loopback): plain HTTP, token-only auth", self.url)
        log.info("rollout ingest listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Answer every post ``queue_closed``, wait (up to ``close_grace_s``) until recent producers have heard
        it, then close the sending end and the HTTP server. Idempotent."""
        self._stopping = True
        runner, self._runner = self._runner, None
        now = asyncio.get_running_loop().time()
        for deadline in list(self._deadlines):  # posts waiting for room answer "closed" now
            deadline.reschedule(now)
        try:
            if runner is not None:
                await self._wait_until_told()
        finally:
            self.sender.close()
            if runner is not None:
                await runner.cleanup()
                log.info("rollout ingest on %s stopped: %s", self.url, dict(self.counters))

    async def __aenter__(self) -> RolloutIngestServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def metrics(self) -> dict[str, float]:
        return {f"ingest/{key}": value for key, value in sorted(self.counters.items())}

    async def _wait_until_told(self) -> None:
        deadline = time.monotonic() + self.config.close_grace_s
        while waiting := self.unnotified():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("rollout ingest stopping before producers %s heard that the queue closed "
                            "(close_grace_s=%s)", waiting, self.config.close_grace_s)
                return
            self._told.clear()
            try:
                await asyncio.wait_for(self._told.wait(), left)
            except TimeoutError:
                pass

    # -- handlers

    async def _health(self, request: web.Request) -> dict[str, Any]:
        return {"ok": True, "closed": self.closed}

    async def _leave(self, request: web.Request) -> dict[str, Any]:
        self._forget(request.headers.get(PRODUCER_HEADER, "")[:MAX_PRODUCER_ID])
        return {"ok": True}

    async def _stats(self, request: web.Request) -> dict[str, Any]:
        queue = dict(self._queue_metrics()) if self._queue_metrics is not None else {}
        return {"closed": self.closed, "counters": dict(self.counters), "unnotified": self.unnotified(),
                "queue": queue}

    async def _post_groups(self, request: web.Request) -> dict[str, Any]:
        producer = request.headers.get(PRODUCER_HEADER, "")[:MAX_PRODUCER_ID] or None
        if producer is not None and not self.closed:
            self._seen(producer)
        body = await read_body(request, self.config.max_body_bytes)
        # Parsing and checking a 4 MiB body takes tens of ms: off the loop, so the learner's tasks keep going.
        groups = await asyncio.to_thread(_decode_request, body, self.config.max_groups_per_request)
        results = [PENDING] * len(groups)
        try:
            await self._send_all(groups, results)
        except HTTPError as exc:
            if exc.fields.get("reason") == QUEUE_CLOSED and producer is not None:
                self._forget(producer)  # told: nothing more to wait for
            raise
        finally:
            for outcome in results:
                self.counters[f"groups_{outcome}"] += 1
        return _outcome(results)

    async def _send_all(self, groups: list[RolloutGroup], results: list[str]) -> None:
        """Send groups in order; on timeout or close, a 503 listing which ones were not stored. A send cut
        short stores nothing, so "pending" is exact."""
        try:
            if not self.closed:
                async with asyncio.timeout(self.config.put_timeout_s) as deadline:
                    self._deadlines.add(deadline)
                    try:
                        for i, group in enumerate(groups):
                            results[i] = STORED if await self.sender.send(group) else DUPLICATE
                    finally:
                        self._deadlines.discard(deadline)
                return
        except TimeoutError:
            if not self._stopping:  # else ``stop`` cut the wait short: the answer is "closed"
                raise HTTPError(503, f"queue full for {self.config.put_timeout_s}s; retry the pending groups",
                                headers={"Retry-After": str(self.config.retry_after_s)}, reason=QUEUE_FULL,
                                **_outcome(results)) from None
        except QueueClosed:
            self._queue_closed = True
        raise HTTPError(503, "rollout queue is closed (the run is ending)", reason=QUEUE_CLOSED, **_outcome(results))

    # -- bookkeeping

    def _seen(self, producer: str) -> None:
        self._last_post[producer] = time.monotonic()
        if len(self._last_post) > _FORGET_AT:
            cutoff = time.monotonic() - self.config.active_window_s
            self._last_post = {p: t for p, t in self._last_post.items() if t >= cutoff}

    def _forget(self, producer: str) -> None:
        if self._last_post.pop(producer, None) is not None:
            self._told.set()

    def _count_post(self, status: int) -> None:
        self.counters[f"http_{status}"] += 1
        self._count_auth(status)

    def _count_auth(self, status: int) -> None:
        if status == 401:
            self.counters["auth_failures"] += 1


class _TooManyGroups(Exception):
    pass


def _decode_request(body: bytes, max_groups: int) -> list[RolloutGroup]:
    """Validate every group before any is stored: a 400 leaves the queue untouched."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request("body", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"groups"}:
        raise bad_request("body", 'must be a JSON object {"groups": [...]}')
    items = obj["groups"]
    if not isinstance(items, list):
        raise bad_request("groups", "must be a JSON array")
    if len(items) > max_groups:
        raise HTTPError(413, f"groups: {len(items)} groups > max_groups_per_request={max_groups}")
    groups = []
    for i, item in enumerate(items):
        try:
            groups.append(group_from_json(item))
        except WireError as exc:
            error = exc.within(f"groups[{i}]")
            log.warning("ingest: rejected request: %s", error)
            raise bad_request(error.path, error.detail) from None
    return groups
