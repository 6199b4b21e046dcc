"""Client-side HTTP plumbing shared by asyncrl's clients of its own servers (engine control, rollout ingest).

``JSONClient`` sends the bearer token with every request, creates its aiohttp session lazily (a session needs
a running event loop), and returns every answer, whatever its status, as a ``Reply`` with the decoded body.
Only a request that got no answer at all (connection refused or reset, a timeout, a broken payload) raises,
and always as ``TransportError``: callers decide what is worth retrying from these two shapes alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from asyncrl.errors import ConfigError
from asyncrl.http.server import check_token


class TransportError(Exception):
    """A request got no answer: connection refused or reset, a timeout, a broken payload."""

    def __init__(self, method: str, url: str, cause: BaseException) -> None:
        super().__init__(f"{method} {url} failed: {cause!r}")
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer. ``body`` is the decoded JSON object, or ``{"error": <text>}`` when it was not one."""

    status: int
    body: dict[str, Any]
    retry_after_s: float | None  # the Retry-After header, when given in seconds

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error(self) -> str:
        return str(self.body.get("error", self.body))


class JSONClient:
    """JSON requests to ``base_url`` + path with ``Authorization: Bearer <token>``.

    ``owner`` names the configuring class in ``ConfigError`` fields. A ``session`` passed in is used as it is
    and never closed here; otherwise one is created on the first call and closed by ``close``."""

    def __init__(self, base_url: str, token: str, *, owner: str, timeout_s: float = 30.0,
                 session: aiohttp.ClientSession | None = None, headers: Mapping[str, str] | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{owner}.url", f"must be an http(s) URL, got {base_url!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ConfigError(f"{owner}.timeout_s", f"must be > 0, got {timeout_s!r}")
        self.base_url = base_url.rstrip("/")
        self.owner = owner
        self._headers = {"Authorization": f"Bearer {check_token(f'{owner}.token', token)}", **(headers or {})}
        self._timeout_s = timeout_s
        self._session = session
        self._owns_session = session is None
        self._closed = False

    def __repr__(self) -> str:  # never show the token
        return f"JSONClient({self.base_url!r})"

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                   data: bytes | None = None, timeout_s: float | None = None) -> Reply:
        """Send ``body`` as JSON (or ``data``, bytes already encoded as JSON) and return the answer.

        ``timeout_s``: None = the client's default; ``math.inf`` = no limit. Raises ``TransportError``."""
        url = self.base_url + path
        total = self._timeout_s if timeout_s is None else None if math.isinf(timeout_s) else timeout_s
        headers = self._headers if data is None else {**self._headers, "Content-Type": "application/json"}
        try:
            async with self._session_or_new().request(method, url, json=body, data=data, headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=total)) as resp:
                return Reply(resp.status, _decode(await resp.read()), _retry_after(resp))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(method, url, exc) from exc

    async def close(self) -> None:
        """Close the session if this client created it. Idempotent; later calls raise ``RuntimeError``."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None and self._owns_session:
            await session.close()

    def _session_or_new(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError(f"{self.owner} is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session


def _decode(raw: bytes) -> dict[str, Any]:
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text) if text else {}
    except ValueError:
        return {"error": text[:500]}
    return body if isinstance(body, dict) else {"error": text[:500]}


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = resp.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None  # the HTTP-date form: the caller's own backoff applies
