"""The rollout queue over HTTP: producers in other processes or hosts ship groups to the learner's queue.

``RolloutIngestServer`` runs next to the learner and feeds its ``RolloutQueue``; ``RemoteQueueClient`` is a
``GroupSink`` a producer can use instead of a local queue. Backpressure crosses the wire: when the queue
stays full for ``put_timeout_s`` the server answers 503 + ``Retry-After`` and the client retries, so a
remote ``put`` waits on a full queue just like a local one. Group ids are idempotent (the queue stores an
id once), which is what makes every retry safe.

Endpoints: ``POST /v1/groups`` (auth) body ``{"groups": [wire group, ...]}``; ``GET /v1/health`` (no auth);
``GET /v1/stats`` (auth). Plain HTTP with a bearer token: bind to loopback, or put TLS in front.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import aiohttp
from aiohttp import web

from asyncrl.config import ConfigError
from asyncrl.queues.rollout_queue import QueueClosed, RolloutQueue
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

MiB = 1 << 20
GROUPS_PATH = "/v1/groups"
HEALTH_PATH = "/v1/health"
STATS_PATH = "/v1/stats"

# Per-group outcomes in a response's "results", aligned with the request's groups.
STORED, DUPLICATE, PENDING = "stored", "duplicate", "pending"
# 503 reasons: a full queue is worth retrying, a closed one never is.
QUEUE_FULL, QUEUE_CLOSED = "queue_full", "queue_closed"


@runtime_checkable
class GroupSink(Protocol):
    """Where a producer ships finished groups: a local ``RolloutQueue`` or a ``RemoteQueueClient``."""

    async def put(self, group: RolloutGroup) -> bool:
        """Store ``group``, waiting while the sink is full. False if its id was already stored."""
        ...


def _config_check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class IngestServerConfig:
    """The ingestion server. Validated at construction; errors name the field."""

    token: str = field(repr=False)  # shared secret clients send as ``Authorization: Bearer <token>``
    host: str = "127.0.0.1"  # interface to bind; loopback unless you mean to expose it
    port: int = 0  # TCP port; 0 = an ephemeral port (``start()`` returns the real one)
    max_body_bytes: int = 4 * MiB  # request bodies above this get 413
    put_timeout_s: float = 5.0  # how long a request waits for queue room before 503 + Retry-After
    max_groups_per_request: int = 64  # more groups in one request get 413
    retry_after_s: int = 1  # Retry-After sent with a queue-full 503 (s); 0 = re-post at once (long poll)

    def __post_init__(self) -> None:
        name = type(self).__name__
        _config_check(isinstance(self.token, str) and bool(self.token), f"{name}.token",
                      "must be a non-empty string")
        _config_check(self.token.isascii() and self.token.isprintable() and " " not in self.token,
                      f"{name}.token", "must be printable ASCII without spaces (it travels in a header)")
        _config_check(isinstance(self.host, str) and bool(self.host), f"{name}.host", "must be a non-empty string")
        _config_check(_is_int(self.port) and 0 <= self.port <= 65535, f"{name}.port",
                      f"must be an integer in [0, 65535], got {self.port!r}")
        for attr in ("max_body_bytes", "max_groups_per_request"):
            value = getattr(self, attr)
            _config_check(_is_int(value) and value > 0, f"{name}.{attr}", f"must be a positive integer, got {value!r}")
        _config_check(isinstance(self.put_timeout_s, (int, float)) and math.isfinite(self.put_timeout_s)
                      and self.put_timeout_s > 0, f"{name}.put_timeout_s", f"must be > 0, got {self.put_timeout_s!r}")
        _config_check(_is_int(self.retry_after_s) and self.retry_after_s >= 0, f"{name}.retry_after_s",
                      f"must be a non-negative integer, got {self.retry_after_s!r}")


# ---------------------------------------------------------------- server


def _json_error(cls: type[web.HTTPException], message: str, *, headers: dict[str, str] | None = None,
                **extra: Any) -> web.HTTPException:
    body = json.dumps({"error": message, **extra})
    if cls is web.HTTPRequestEntityTooLarge:
        return web.HTTPRequestEntityTooLarge(0, text=body, content_type="application/json", headers=headers)
    return cls(text=body, content_type="application/json", headers=headers)


def _outcome(results: list[str]) -> dict[str, Any]:
    return {"stored": results.count(STORED), "duplicates": results.count(DUPLICATE), "results": results}


class RolloutIngestServer:
    """HTTP front of a ``RolloutQueue``. ``async with RolloutIngestServer(q, cfg) as srv: srv.url``."""

    def __init__(self, queue: RolloutQueue, config: IngestServerConfig) -> None:
        self.queue = queue
        self.config = config
        self.counts: Counter[str] = Counter()  # requests by outcome, groups by fate
        self.url: str | None = None
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_post(GROUPS_PATH, self._post_groups)
        self.app.router.add_get(HEALTH_PATH, self._health)
        self.app.router.add_get(STATS_PATH, self._stats)
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Bind and serve. Returns the base URL with the real port (``http://127.0.0.1:41234``)."""
        if self._runner is not None:
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
        """Stop accepting connections and finish in-flight requests (each bounded by put_timeout_s)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            log.info("rollout ingest on %s stopped: %s", self.url, dict(self.counts))

    async def __aenter__(self) -> RolloutIngestServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def metrics(self) -> dict[str, float]:
        return {f"ingest/{key}": value for key, value in sorted(self.counts.items())}

    # -- handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "closed": self.queue.closed})

    async def _stats(self, request: web.Request) -> web.Response:
        self._authorise(request)
        return web.json_response({
            "depth": self.queue.depth, "capacity": self.queue.config.capacity, "closed": self.queue.closed,
            "counts": dict(self.counts), "queue": self.queue.metrics(),
        })

    async def _post_groups(self, request: web.Request) -> web.Response:
        try:
            self._authorise(request)
            groups = await self._read_groups(request)
            results = await self._enqueue(groups)
        except web.HTTPException as exc:
            self.counts[f"http_{exc.status}"] += 1
            raise
        self.counts["http_200"] += 1
        return web.json_response(_outcome(results))

    # -- steps of POST /v1/groups

    def _authorise(self, request: web.Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        expected = self.config.token.encode()
        # compare_digest: the time taken must not reveal how much of a guessed token was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            self.counts["auth_failures"] += 1
            log.warning("ingest: rejected unauthenticated request from %s", request.remote)
            raise _json_error(web.HTTPUnauthorized, "missing or invalid bearer token",
                              headers={"WWW-Authenticate": 'Bearer realm="asyncrl"'})

    async def _read_groups(self, request: web.Request) -> list[RolloutGroup]:
        body = await self._read_body(request)
        # Parsing and checking a 4 MiB body takes tens of ms: off the loop, so the learner's tasks keep going.
        try:
            return await asyncio.to_thread(_decode_request, body, self.config.max_groups_per_request)
        except WireError as exc:
            log.warning("ingest: rejected request: %s", exc)
            raise _json_error(web.HTTPBadRequest, str(exc), field=exc.path) from None
        except _TooManyGroups as exc:
            raise _json_error(web.HTTPRequestEntityTooLarge, str(exc)) from None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        too_large = f"request body exceeds max_body_bytes={limit}"
        if request.content_length is not None and request.content_length > limit:
            raise _json_error(web.HTTPRequestEntityTooLarge, f"{too_large} (Content-Length {request.content_length})")
        try:
            return await request.read()  # client_max_size enforces the limit for chunked bodies
        except web.HTTPRequestEntityTooLarge:
            raise _json_error(web.HTTPRequestEntityTooLarge, too_large) from None

    async def _enqueue(self, groups: list[RolloutGroup]) -> list[str]:
        """Put groups in order; on timeout or close, answer 503 listing which ones were not stored."""
        results = [PENDING] * len(groups)
        try:
            async with asyncio.timeout(self.config.put_timeout_s):
                for i, group in enumerate(groups):
                    # A put cancelled by the timeout stores nothing, so "pending" is exact.
                    results[i] = STORED if await self.queue.put(group) else DUPLICATE
        except TimeoutError:
            self._count_groups(results)
            raise _json_error(web.HTTPServiceUnavailable,
                              f"queue full for {self.config.put_timeout_s}s; retry the pending groups",
                              headers={"Retry-After": str(self.config.retry_after_s)},
                              reason=QUEUE_FULL, **_outcome(results)) from None
        except QueueClosed:
            self._count_groups(results)
            raise _json_error(web.HTTPServiceUnavailable, "rollout queue is closed (the run is ending)",
                              reason=QUEUE_CLOSED, **_outcome(results)) from None
        self._count_groups(results)
        return results

    def _count_groups(self, results: list[str]) -> None:
        for outcome in results:
            self.counts[f"groups_{outcome}"] += 1


class _TooManyGroups(Exception):
    pass


def _decode_request(body: bytes, max_groups: int) -> list[RolloutGroup]:
    """Validate every group before any is stored: a 400 leaves the queue untouched."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError("body", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"groups"}:
        raise WireError("body", 'must be a JSON object {"groups": [...]}')
    items = obj["groups"]
    if not isinstance(items, list):
        raise WireError("groups", "must be a JSON array")
    if len(items) > max_groups:
        raise _TooManyGroups(f"groups: {len(items)} groups > max_groups_per_request={max_groups}")
    groups = []
    for i, item in enumerate(items):
        try:
            groups.append(group_from_json(item))
        except WireError as exc:
            raise exc.within(f"groups[{i}]") from None
    return groups


# ---------------------------------------------------------------- client


class RemoteQueueError(Exception):
    """The server refused groups (``status`` 400/401/413/...), or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class RemoteQueueClosed(RemoteQueueError, QueueClosed):
    """The remote queue is closed. Also a ``QueueClosed``, so producers handle both sinks alike."""


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: dict[str, Any]  # parsed JSON, or {"error": <text>} when the server did not send JSON
    retry_after_s: float | None


class RemoteQueueClient:
    """A ``GroupSink`` that ships groups to a ``RolloutIngestServer``.

    A full remote queue is backpressure, not failure: ``put`` keeps retrying (honouring Retry-After) for as
    long as the queue stays full, like ``RolloutQueue.put``; cancel it to stop waiting. Connection errors,
    timeouts and other 5xx are retried ``max_retries`` times with exponential backoff, then raise
    ``RemoteQueueError``. After a lost response a group may come back as a duplicate of itself: it is
    stored once either way, but ``put`` then returns False.
    """

    def __init__(self, url: str, token: str, *, session: aiohttp.ClientSession | None = None,
                 max_retries: int = 5, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 timeout_s: float = 30.0, max_groups_per_request: int = 64) -> None:
        name = type(self).__name__
        _config_check(url.startswith(("http://", "https://")), f"{name}.url", f"must be an http(s) URL, got {url!r}")
        _config_check(bool(token), f"{name}.token", "must be a non-empty string")
        _config_check(_is_int(max_retries) and max_retries >= 0, f"{name}.max_retries", "must be an integer >= 0")
        _config_check(0 < backoff_s <= max_backoff_s, f"{name}.backoff_s", "must be in (0, max_backoff_s]")
        # Must exceed the server's put_timeout_s, or every wait for room ends as a client timeout.
        _config_check(timeout_s > 0, f"{name}.timeout_s", "must be > 0")
        _config_check(_is_int(max_groups_per_request) and max_groups_per_request > 0,
                      f"{name}.max_groups_per_request", "must be a positive integer")
        self.url = url.rstrip("/") + GROUPS_PATH
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._session = session
        self._owns_session = session is None
        self._max_retries, self._backoff_s, self._max_backoff_s = max_retries, backoff_s, max_backoff_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_groups = max_groups_per_request

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}({self.url!r})"

    async def put(self, group: RolloutGroup) -> bool:
        """Ship one group; True if stored, False if its id was already stored."""
        return (await self.put_many([group]))[0]

    async def put_many(self, groups: Sequence[RolloutGroup]) -> list[bool]:
        """Ship groups in order, ``max_groups_per_request`` per request; one bool per group as ``put``."""
        out: list[bool] = []
        for start in range(0, len(groups), self._max_groups):
            out += await self._ship(groups[start:start + self._max_groups])
        return out

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> RemoteQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals

    async def _ship(self, groups: Sequence[RolloutGroup]) -> list[bool]:
        encoded = await asyncio.to_thread(_encode_groups, groups)  # WireError here: our group is bad
        outcome: dict[int, bool] = {}
        pending = list(range(len(groups)))
        failures = 0
        while pending:
            reply = await self._post_or_none([encoded[i] for i in pending])
            if reply is not None and "results" in reply.body:
                pending = _apply_results(reply.body["results"], pending, outcome)
            if reply is not None and reply.status == 200:
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

    async def _post_or_none(self, encoded: list[bytes]) -> _Reply | None:
        """POST the groups; None when the attempt failed in transport (worth retrying)."""
        body = b'{"groups":[' + b",".join(encoded) + b"]}"
        session = self._session_or_new()
        try:
            async with session.post(self.url, data=body, headers=self._headers, timeout=self._timeout) as resp:
                return _Reply(resp.status, await _json_body(resp), _retry_after(resp))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            log.warning("remote queue %s unreachable: %r", self.url, exc)
            return None

    def _session_or_new(self) -> aiohttp.ClientSession:
        if self._session is None:
            if not self._owns_session:
                raise RuntimeError("RemoteQueueClient is closed")
            self._session = aiohttp.ClientSession()  # created lazily: it needs a running loop
        return self._session

    def _raise_if_final(self, reply: _Reply | None) -> None:
        if reply is None or reply.status >= 500 and reply.body.get("reason") != QUEUE_CLOSED:
            return  # transport error or server trouble: retry
        message = str(reply.body.get("error", reply.body))
        if reply.body.get("reason") == QUEUE_CLOSED:
            raise RemoteQueueClosed(reply.status, message)
        raise RemoteQueueError(reply.status, message)  # 4xx: the same request would fail again

    def _delay(self, failures: int, reply: _Reply | None) -> float:
        delay = min(self._max_backoff_s, self._backoff_s * 2 ** (failures - 1))
        if reply is not None and reply.retry_after_s is not None:
            delay = max(delay, reply.retry_after_s)
        return delay


def _encode_groups(groups: Sequence[RolloutGroup]) -> list[bytes]:
    return [json.dumps(group_to_json(g), separators=(",", ":"), allow_nan=False).encode() for g in groups]


def _apply_results(results: Any, pending: list[int], outcome: dict[int, bool]) -> list[int]:
    """Record stored/duplicate answers; return the indices still to send."""
    if not isinstance(results, list) or len(results) != len(pending):
        raise RemoteQueueError(None, f"malformed server reply: results {results!r} for {len(pending)} groups")
    still: list[int] = []
    for index, result in zip(pending, results):
        if result == PENDING:
            still.append(index)
        else:
            outcome[index] = result == STORED
    return still


async def _json_body(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await resp.text()
    try:
        body = json.loads(text)
    except ValueError:
        return {"error": text[:500]}
    return body if isinstance(body, dict) else {"error": text[:500]}


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = resp.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None  # HTTP-date form: fall back to our own backoff


def _describe(reply: _Reply | None) -> str:
    return "connection failed" if reply is None else f"HTTP {reply.status}: {reply.body.get('error', '')}"
