"""Server-side HTTP plumbing shared by asyncrl's aiohttp servers (engine control, rollout ingest).

One way to do each thing, so every server answers alike:

- tokens are checked when a server is configured: ``check_token`` raises a ``ConfigError`` naming the field;
- ``BearerAuth`` checks ``Authorization: Bearer <token>`` in constant time (``hmac.compare_digest``);
- every error is JSON ``{"error": message, ...}`` with the status of an ``HTTPError``: 401 carries
  ``WWW-Authenticate``, 400 names the bad field in the message and as ``"field"``;
- ``read_body`` reads a request body under a size limit (413 beyond it), ``parse_json_object`` checks a JSON
  object body field by field (400 naming the field);
- ``json_endpoint`` wraps a handler that returns a dict: auth first, then the handler, then any error as JSON.

The transport is plain HTTP with a token only: bind to loopback, or put TLS in front.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from asyncrl.errors import ConfigError

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
REALM = "asyncrl"
READ_CHUNK = 64 * KiB

# How a field's expected type is named in a 400: the client may not be Python.
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a JSON array",
               dict: "a JSON object"}


def check_token(field: str, token: object) -> str:
    """``token`` if it can travel in an ``Authorization`` header, else ``ConfigError(field)``."""
    if not isinstance(token, str) or not token:
        raise ConfigError(field, "must be a non-empty string")
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(field, "must be printable ASCII without spaces (it travels in a header)")
    return token


class HTTPError(Exception):
    """An answer other than 200: ``status``, a message, extra JSON ``fields`` and ``headers``."""

    def __init__(self, status: int, message: str, *, headers: Mapping[str, str] | None = None,
                 **fields: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.fields = fields

    def response(self) -> web.Response:
        return error_response(self.status, self.message, headers=self.headers, **self.fields)


def bad_request(field: str, message: str) -> HTTPError:
    """A 400 naming the field that was wrong (``body`` when the whole body was)."""
    return HTTPError(400, f"{field}: {message}", field=field)


def error_response(status: int, message: str, *, headers: Mapping[str, str] | None = None,
                   **fields: Any) -> web.Response:
    headers = dict(headers or {})
    if status == 401:  # RFC 9110: a 401 says which scheme would be accepted
        headers.setdefault("WWW-Authenticate", f'Bearer realm="{REALM}"')
    return web.json_response({"error": message, **fields}, status=status, headers=headers)


class BearerAuth:
    """Checks the bearer token of a request; ``name`` says whose token in logs (never the token itself)."""

    def __init__(self, token: str, field: str, name: str) -> None:
        self._token = check_token(field, token).encode()
        self.name = name

    def __repr__(self) -> str:
        return f"BearerAuth({self.name!r})"

    def check(self, request: web.Request) -> None:
        """Raise a 401 ``HTTPError`` unless the request carries the token."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of a guessed token was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            log.warning("%s: rejected unauthenticated request from %s", self.name, request.remote)
            raise HTTPError(401, "missing or invalid bearer token")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, or a 413 once it exceeds ``limit`` bytes (by Content-Length or as it streams in)."""
    too_large = f"request body exceeds max_body_bytes={limit}"
    if request.content_length is not None and request.content_length > limit:
        raise HTTPError(413, f"{too_large} (Content-Length {request.content_length})")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(READ_CHUNK):  # a chunked body has no Content-Length
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, too_large)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes, fields: Mapping[str, type], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw`` as a JSON object with exactly ``fields`` (all but ``optional`` required), each of its type.

    A bool is not an integer, and a number field takes integers too (JSON does not tell ``1`` from ``1.0``).
    Raises a 400 ``HTTPError`` naming the field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request("body", f"not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("body", f"must be a JSON object with {sorted(fields)}")
    if not set(fields) - set(optional) <= set(body) <= set(fields):
        note = f" ({sorted(optional)} optional)" if optional else ""
        raise bad_request("body", f"expected fields {sorted(fields)}{note}, got {sorted(body)}")
    for name, value in body.items():
        if not _is(value, fields[name]):
            raise bad_request(name, f"must be {_TYPE_NAMES.get(fields[name], fields[name].__name__)}, got {value!r}")
    return body


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return type(value) is int
    if kind is float:
        return type(value) in (int, float) and math.isfinite(value)
    return isinstance(value, kind)


async def read_json_object(request: web.Request, fields: Mapping[str, type], optional: tuple[str, ...] = (),
                           limit: int = 64 * KiB) -> dict[str, Any]:
    """``read_body`` then ``parse_json_object``: for the small control bodies parsed on the event loop."""
    return parse_json_object(await read_body(request, limit), fields, optional)


Handler = Callable[[web.Request], Awaitable[Mapping[str, Any]]]
ErrorMap = Callable[[Exception], "HTTPError | None"]


def json_endpoint(handler: Handler, *, auth: BearerAuth | None = None, errors: ErrorMap | None = None,
                  on_reply: Callable[[int], None] | None = None) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler around ``handler``: checks ``auth``, answers the dict it returns as JSON 200, and any
    failure as a JSON error. ``errors`` maps a domain exception to an ``HTTPError`` (None: a 500, logged);
    ``on_reply`` sees every status answered (for counters)."""

    async def endpoint(request: web.Request) -> web.Response:
        try:
            if auth is not None:
                auth.check(request)
            response = web.json_response(dict(await handler(request)))
        except HTTPError as exc:
            response = exc.response()
        except Exception as exc:
            mapped = errors(exc) if errors is not None else None
            if mapped is None:
                log.exception("%s %s failed", request.method, request.path)
                mapped = HTTPError(500, f"{type(exc).__name__}: {exc}")
            response = mapped.response()
        if on_reply is not None:
            on_reply(response.status)
        return response

    return endpoint
