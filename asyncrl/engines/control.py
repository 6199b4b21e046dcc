"""Driving an engine embedded in a service from a learner in another process, over HTTP.

Server side, inside the service that owns the engine (and its event loop): ``EngineControl`` (or the
shortcut ``engine_control_routes``) adds five routes to the service's own aiohttp app::

    POST {prefix}/prepare  {"version": int, "path": "/dev/shm/.asyncrl-staging-x"} -> {"prepared": int}
    POST {prefix}/pause    {"mode": "keep"|"wait"|"abort", "clear_cache": bool}   -> {"paused": true, ...}
    POST {prefix}/weights  {"version": int} (the prepared one) or {"version", "path"} -> {"version": int}
    POST {prefix}/resume                                                          -> {"paused": false, ...}
    GET  {prefix}/version                                                         -> {"version", "max_model_len", ...}
    GET  {prefix}/health   (no auth)                                              -> {"ok": true} or 503

Every route but health needs ``Authorization: Bearer <token>`` (401 otherwise). Errors are JSON
``{"error": ...}``: 400 bad request body or unreadable weights, 403 weights outside ``weights_root``, 409 the
engine refused the update (``WeightUpdateError``: nothing applied, version unchanged), 503 engine not started
yet or dead, 500 anything else. The host app decides where it listens: keep it on 127.0.0.1, or put TLS in
front (plain HTTP, token-only auth).

Weights travel as files: the learner stages a safetensors directory on a filesystem both processes see
(``/dev/shm`` on one machine), posts its path, and deletes it once answered; the service reads the tensors in
a worker thread. ``prepare`` does that, plus the engine's own checks and staging (``PreparesUpdates``), while
generation still runs, so the pause covers only the load; the service holds one prepared update at a time (a
new prepare replaces it). ``weights`` with a path does all of it in one call. A learner that dies between
pause and resume would leave generation paused forever, so a pause is a lease: without a resume (or a weights
post) within ``max_pause_s`` the service resumes by itself.

Client side, in the learner's process: ``RemoteControlEngine`` is the control half of the Engine Protocol
(pause / update_weights / resume / version / check_alive / close), so the standard ``WeightSync`` and
``Learner`` drive the embedded engine unchanged. It does not generate: producers live next to the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from asyncrl.config import ConfigError, SamplingConfig
from asyncrl.engines.base import Engine, EngineError, PreparesUpdates, WeightUpdate, WeightUpdateError
from asyncrl.engines.weights import read_manifest, staging_root, torch_dtype, validate_and_stage
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/asyncrl"


def _check_token(owner: str, token: object) -> str:
    if not isinstance(token, str) or not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"{owner}.token", "must be a non-empty printable ASCII string without spaces")
    return token


# ---------------------------------------------------------------- server


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Action = Callable[[Engine, web.Request], Awaitable[dict[str, Any]]]


class EngineControl:
    """HTTP control of ``engine`` for a learner in another process. Add ``routes()`` to the host app."""

    def __init__(self, engine: Engine | None, token: str, *, max_pause_s: float = 300.0,
                 weights_root: str | Path | None = None) -> None:
        self._engine = engine
        self._token = _check_token("EngineControl", token).encode()
        if not isinstance(max_pause_s, int | float) or not max_pause_s > 0:
            raise ConfigError("EngineControl.max_pause_s", f"must be > 0 (math.inf: no lease), got {max_pause_s!r}")
        self.max_pause_s = max_pause_s  # a pause with no resume or weights post for this long is undone
        # When set, posted weight paths must lie under it (403 otherwise); None trusts the token holder.
        self.weights_root = Path(weights_root).resolve() if weights_root is not None else None
        self.paused = False
        self.counts: Counter[str] = Counter()  # requests by route and HTTP status
        self._lock = asyncio.Lock()  # one control call at a time
        self._lease: asyncio.Task[None] | None = None
        self._prepared: WeightUpdate | None = None  # the update ``prepare`` readied for the next load

    @property
    def engine(self) -> Engine | None:
        """The engine under control; None until the service's engine is up (calls answer 503 meanwhile)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self._discard_prepared()  # prepared for the old engine (and holding its staging directory)
        self._engine = engine

    def routes(self, prefix: str = CONTROL_PREFIX) -> list[web.RouteDef]:
        prefix = prefix.rstrip("/")
        return [
            self._route("POST", f"{prefix}/prepare", self._prepare),
            self._route("POST", f"{prefix}/pause", self._pause),
            self._route("POST", f"{prefix}/resume", self._resume),
            self._route("POST", f"{prefix}/weights", self._weights),
            self._route("GET", f"{prefix}/version", self._version),
            self._route("GET", f"{prefix}/health", self._health, auth=False),
        ]

    async def close(self) -> None:
        """Cancel a pending pause lease and drop a prepared update (call from the service's cleanup)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)
        self._discard_prepared()

    def metrics(self) -> dict[str, float]:
        return {f"control/{key}": value for key, value in sorted(self.counts.items())} | {
            "control/paused": float(self.paused)}

    # -- plumbing

    def _route(self, method: str, path: str, action: Action, auth: bool = True) -> web.RouteDef:
        name = path.rsplit("/", 1)[-1]

        async def handler(request: web.Request) -> web.Response:
            response = await self._handle(request, action, auth)
            self.counts[f"{name}_{response.status}"] += 1
            return response

        return web.route(method, path, handler)

    async def _handle(self, request: web.Request, action: Action, auth: bool) -> web.Response:
        try:
            if auth:
                self._authorise(request)
            if self.engine is None:
                raise _HTTPError(503, "engine not started yet")
            return web.json_response(await action(self.engine, request))
        except _HTTPError as exc:
            return _error(exc.status, str(exc))
        except WeightUpdateError as exc:
            return _error(409, str(exc))
        except EngineError as exc:
            return _error(503, str(exc))
        except Exception as exc:
            log.exception("engine control %s %s failed", request.method, request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    def _authorise(self, request: web.Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of a guessed token was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            log.warning("engine control: rejected unauthenticated request from %s", request.remote)
            raise _HTTPError(401, "missing or invalid bearer token")

    # -- actions

    async def _pause(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await _json_object(request, {"mode": str, "clear_cache": bool})
        try:
            mode = PauseMode(body["mode"])
        except ValueError:
            raise _HTTPError(400, f"mode: must be one of {[m.value for m in PauseMode]}, "
                                  f"got {body['mode']!r}") from None
        async with self._lock:
            await engine.pause(mode, body["clear_cache"])
            self.paused = True
            self._start_lease(engine)
        return {"paused": True, "version": engine.version}

    async def _resume(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        async with self._lock:
            self._cancel_lease()
            await engine.resume()
            self.paused = False
        return {"paused": False, "version": engine.version}

    async def _prepare(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await _json_object(request, {"version": int, "path": str})
        update = await self._read_update(body)
        async with self._lock:
            self._discard_prepared()
            if isinstance(engine, PreparesUpdates):
                update = await engine.prepare_update(update)  # checks + staging, generation still running
            self._prepared = update
        return {"prepared": update.version}

    async def _weights(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await _json_object(request, {"version": int, "path": str}, optional=("path",))
        t0 = time.perf_counter()
        update = await self._read_update(body) if "path" in body else None
        async with self._lock:
            if update is None:
                update, self._prepared = self._prepared, None
                if update is None or update.version != body["version"]:
                    self._prepared = update
                    raise WeightUpdateError(f"no prepared update for version {body['version']} "
                                            f"(prepared: {update.version if update else None}); prepare it first")
            await engine.update_weights(update)
            if self.paused:
                self._start_lease(engine)  # the load took time out of the lease; give the resume a full one
        log.info("engine control: loaded v%d in %.2fs", engine.version, time.perf_counter() - t0)
        return {"version": engine.version}

    async def _read_update(self, body: dict[str, Any]) -> WeightUpdate:
        if body["version"] < 0:
            raise _HTTPError(400, f"version: must be >= 0, got {body['version']}")
        tensors = await asyncio.to_thread(_read_tensors, self._weights_dir(body["path"]))
        return WeightUpdate(version=body["version"], tensors=tensors)

    def _discard_prepared(self) -> None:
        update, self._prepared = self._prepared, None
        if update is not None and isinstance(self._engine, PreparesUpdates):
            self._engine.discard_update(update)

    async def _version(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        return {"version": engine.version, "max_model_len": engine.max_model_len, "name": engine.name,
                "paused": self.paused}

    async def _health(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        await engine.check_alive()  # EngineError -> 503
        return {"ok": True}

    def _weights_dir(self, given: str) -> Path:
        path = Path(given)
        if not path.is_absolute():
            raise _HTTPError(400, f"path: must be absolute, got {given!r}")
        if self.weights_root is not None and not path.resolve().is_relative_to(self.weights_root):
            raise _HTTPError(403, f"path: {given!r} is outside the service's weights_root")
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise _HTTPError(400, f"path: {given!r} is not a directory holding *.safetensors files "
                                  f"(is it on a filesystem this service can read?)")
        return path

    # -- the pause lease

    def _start_lease(self, engine: Engine) -> None:
        self._cancel_lease()
        if math.isfinite(self.max_pause_s):
            self._lease = asyncio.create_task(self._expire(engine), name="asyncrl-pause-lease")

    def _cancel_lease(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    async def _expire(self, engine: Engine) -> None:
        await asyncio.sleep(self.max_pause_s)  # a deadline, not a poll: resume or weights cancel it
        async with self._lock:
            self._lease = None
            log.warning("engine control: no resume within %.0fs of a pause (learner gone?); resuming",
                        self.max_pause_s)
            try:
                await engine.resume()
                self.paused = False
            except Exception:
                log.exception("engine control: resume after an expired pause failed")


def engine_control_routes(engine: Engine, token: str, prefix: str = CONTROL_PREFIX,
                          **kwargs: Any) -> list[web.RouteDef]:
    """The control routes for ``engine`` (``app.add_routes(...)``); ``kwargs`` go to ``EngineControl``.

    Use ``EngineControl`` itself when the engine starts after the app (routes must exist before the app
    starts) or to close the pause lease on cleanup.
    """
    return EngineControl(engine, token, **kwargs).routes(prefix)


def _error(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="asyncrl"'} if status == 401 else None
    return web.json_response({"error": message}, status=status, headers=headers)


async def _json_object(request: web.Request, fields: dict[str, type], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The body as a JSON object with ``fields`` (all but ``optional`` required), each of its type (a bool is
    not an int)."""
    try:
        body = json.loads(await request.text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _HTTPError(400, f"body: not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, f"body: must be a JSON object with {sorted(fields)}")
    if not set(fields) - set(optional) <= set(body) <= set(fields):
        raise _HTTPError(400, f"body: expected fields {sorted(fields)}"
                              f"{f' ({sorted(optional)} optional)' if optional else ''}, got {sorted(body)}")
    for name, kind in fields.items():
        if name not in body:
            continue
        value = body[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _HTTPError(400, f"{name}: must be {kind.__name__}, got {value!r}")
    return body


def _read_tensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    try:
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    except (OSError, SafetensorError) as exc:
        raise _HTTPError(400, f"path: cannot read weights from {path}: {exc}") from None
    return tensors


# ---------------------------------------------------------------- client


class ControlError(EngineError):
    """A control call failed: the service answered ``status`` (401, 503, ...) or, with None, was unreachable."""

    def __init__(self, engine: str, message: str, status: int | None) -> None:
        super().__init__(engine, message)
        self.status = status


class RemoteControlEngine:
    """The control half of the Engine Protocol, over ``EngineControl`` routes in another process.

    Give it to ``WeightSync`` / ``Learner`` as their engine. It is ``PreparesUpdates``: before the pause,
    ``prepare_update`` validates the update against ``model_dir``'s parameters, stages it with
    ``weights.stage`` under ``staging_dir`` (default ``/dev/shm``; the service must be able to read it), has
    the service read and prepare it, and deletes the directory; ``update_weights`` then only asks the paused
    service to load it. An update that was not prepared is staged and posted in one call.
    """

    def __init__(self, url: str, token: str, model_dir: str | Path, *, prefix: str = CONTROL_PREFIX,
                 staging_dir: str | Path | None = None, timeout_s: float = 120.0, health_timeout_s: float = 5.0,
                 name: str | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError("RemoteControlEngine.url", f"must be an http(s) URL, got {url!r}")
        if staging_dir is not None and not Path(staging_dir).is_dir():
            raise ConfigError("RemoteControlEngine.staging_dir", f"{staging_dir!r} is not a directory")
        for field, value in (("timeout_s", timeout_s), ("health_timeout_s", health_timeout_s)):
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"RemoteControlEngine.{field}", f"must be > 0, got {value!r}")
        self.name = name or f"control:{url}"
        self._base = url.rstrip("/") + "/" + prefix.strip("/")
        self._headers = {"Authorization": f"Bearer {_check_token('RemoteControlEngine', token)}"}
        self._manifest = read_manifest(model_dir)  # raises if model_dir has no *.safetensors
        self._dtype = torch_dtype(next(iter(self._manifest.values())).dtype)
        self._staging_root = Path(staging_dir) if staging_dir is not None else staging_root()
        self._timeout_s, self._health_timeout_s = timeout_s, health_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._version = 0
        self._max_model_len = 0
        self._prepared: int | None = None  # version of the update the service holds prepared
        self._closed = False

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}({self._base!r})"

    @classmethod
    async def connect(cls, url: str, token: str, model_dir: str | Path, *, ready_timeout_s: float = 0.0,
                      **kwargs: Any) -> RemoteControlEngine:
        """Build the client and read the engine's version, waiting up to ``ready_timeout_s`` for the service
        (and its engine) to come up."""
        engine = cls(url, token, model_dir, **kwargs)
        try:
            await engine.wait_ready(ready_timeout_s)
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def version(self) -> int:
        """The engine's version as of the last control call (``refresh`` reads it again)."""
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def refresh(self) -> int:
        """GET the engine's version (and context length) from the service."""
        reply = await self._call("GET", "/version")
        self._version, self._max_model_len = int(reply["version"]), int(reply["max_model_len"])
        return self._version

    async def wait_ready(self, timeout_s: float) -> None:
        """``refresh`` until the service answers; retry while it is unreachable or its engine is starting
        (connection refused, 503), with backoff: across processes there is no event to wait on."""
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        while True:
            try:
                await self.refresh()
                return
            except ControlError as exc:
                if exc.status not in (None, 503) or time.monotonic() + delay > deadline:
                    raise
                log.info("waiting for the engine behind %s: %s", self._base, exc)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        raise NotImplementedError(
            f"{self.name} only controls an engine embedded in another process (pause, weights, resume); "
            "it does not generate. Run producers in that process, next to the engine.")

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._call("POST", "/pause", {"mode": PauseMode(mode).value, "clear_cache": clear_cache})

    async def resume(self) -> None:
        await self._call("POST", "/resume", {})

    async def prepare_update(self, update: WeightUpdate) -> WeightUpdate:
        self._prepared = None
        await self._post_staged("/prepare", update)
        self._prepared = update.version
        return update

    def discard_update(self, update: WeightUpdate) -> None:
        self._prepared = None  # the service drops its copy when the next update is prepared

    async def update_weights(self, update: WeightUpdate) -> None:
        prepared, self._prepared = self._prepared == update.version, None
        try:
            if prepared:
                reply = await self._call("POST", "/weights", {"version": update.version})
            else:
                reply = await self._post_staged("/weights", update)
        except ControlError as exc:
            if exc.status is not None or await self._version_or_none() != update.version:
                raise
            log.warning("%s: answer to the weights post was lost, but the engine reports v%d", self.name,
                        update.version)
            reply = {"version": update.version}
        self._version = int(reply["version"])

    async def check_alive(self) -> None:
        try:
            await self._call("GET", "/health", timeout_s=self._health_timeout_s)
        except ControlError as exc:
            raise EngineError(self.name, f"failed its health check: {exc}") from exc

    async def close(self) -> None:
        """Close the HTTP session. The engine belongs to the service and keeps running. Idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- internals

    async def _post_staged(self, path: str, update: WeightUpdate) -> dict[str, Any]:
        """Validate and stage ``update``, post its directory to ``path``, delete the directory once answered."""
        # Refused here, before anything is written or sent.
        staged = await validate_and_stage(update.tensors, self._manifest, self._dtype, self._staging_root)
        try:
            return await self._call("POST", path, {"version": update.version, "path": str(staged)})
        finally:
            shutil.rmtree(staged, ignore_errors=True)  # the service has read the tensors (or failed to)

    async def _version_or_none(self) -> int | None:
        try:
            return await self.refresh()
        except ControlError:
            return None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        if self._closed:
            raise EngineError(self.name, "engine client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)  # lazily: it needs a running loop
        url = self._base + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeout_s)
        try:
            async with self._session.request(method, url, json=body, timeout=timeout) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControlError(self.name, f"{method} {url} failed: {exc!r}", None) from exc
        try:
            reply = json.loads(text)
        except ValueError:
            reply = {"error": text[:500]}
        if status == 200:
            return reply
        message = f"{method} {url}: HTTP {status}: {reply.get('error', reply)}"
        if status == 409:
            raise WeightUpdateError(f"engine {self.name}: {message}")
        raise ControlError(self.name, message, status)
