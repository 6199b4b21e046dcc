"""Engine control routes, inside a service that embeds an engine (server side; the client is ``client.py``).

``EngineControl`` adds these routes to the host service's own aiohttp app (``engine_control_routes`` is the
shortcut when the engine is up before the app starts)::

    POST {prefix}/prepare  {"version": int, "path": "/dev/shm/.asyncrl-staging-x"} -> {"prepared": int}
    POST {prefix}/pause    {"mode": "keep"|"wait"|"abort", "clear_cache": bool}   -> {"paused": true, ...}
    POST {prefix}/weights  {"version": int} (the prepared one) or {"version", "path"} -> {"version": int}
    POST {prefix}/resume                                                          -> {"paused": false, ...}
    GET  {prefix}/version                                                         -> {"version", "max_model_len", ...}
    GET  {prefix}/health   (no auth)                                              -> {"ok": true} or 503

Every route but health needs ``Authorization: Bearer <token>`` (401 otherwise). Errors are JSON
``{"error": ...}``: 400 bad request body or unreadable weights, 403 weights outside ``weights_root``, 409 the
engine refused the update (nothing applied, version unchanged), 503 no engine attached (not started yet, or
detached because the service is stopping) or the engine died, 500 anything else.

Weights travel as files: the learner stages a safetensors directory on a filesystem both processes see
(``/dev/shm`` on one machine) and posts its path; the service reads the tensors in a worker thread, and the
engine's own ``prepare`` checks and stages them while generation still runs, so the pause covers only the
load. The service holds one prepared update at a time and releases it once loaded, when a new one is
prepared, at the next resume (a publication ends with its resume: an update not loaded by then never will
be), or when the engine is detached. ``weights`` with a path prepares, loads and releases in one call.

The pause lease, and the service's side of the shutdown handshake:

- a learner that dies between pause and resume would leave generation paused for ever, so a pause is a
  lease: without a resume (or a weights post) within ``max_pause_s`` the service resumes by itself;
- ``async with control.serving(engine): await producer.run()`` attaches the engine for the producer's life.
  However that ends (the learner closed its queue, a failure, the service stopping), the engine stays
  attached, and these routes keep answering, until no pause is held: the learner's publication in flight
  gets to resume (or the lease, or ``release_timeout_s``, runs out, and the service resumes the engine
  itself). Only then is it detached, under the lock so no call is half-way through, and may be closed. A
  learner's last publication therefore never meets a closed engine. The host must do this before its HTTP
  server stops taking connections: aiohttp's runner cleanup closes the listening sockets first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from asyncrl.aio import TaskOwner, settle
from asyncrl.engines.protocols import Engine, WeightUpdate
from asyncrl.engines.updates import InMemory
from asyncrl.errors import ConfigError, EngineError, WeightUpdateError
from asyncrl.http.server import BearerAuth, HTTPError, bad_request, json_endpoint, read_json_object
from asyncrl.types import PauseMode

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/asyncrl"
RELEASE_TIMEOUT_S = 30.0  # default wait for a held pause to end before the engine is detached
# Why the engine went, in its 503s: a learner reading them must not take a run that ended for a service going.
FINISHED = ("the rollouts finished (their producer ended, e.g. the learner closed its queue); "
            "the service keeps serving")
STOPPING = "the service is shutting down its rollouts"

Action = Callable[[Engine, web.Request], Awaitable[dict[str, Any]]]


def _engine_errors(exc: Exception) -> HTTPError | None:
    if isinstance(exc, WeightUpdateError):
        return HTTPError(409, str(exc))
    if isinstance(exc, EngineError):
        return HTTPError(503, str(exc))
    return None


class EngineControl:
    """HTTP control of an engine for a learner in another process. Add ``routes()`` to the host app.

    The pause lease (a task that resumes the engine if a pause is held too long) is owned by its
    ``TaskOwner``: ``detach`` and ``close`` cancel and await every lease task."""

    def __init__(self, engine: Engine | None, token: str, *, max_pause_s: float = 300.0,
                 weights_root: str | Path | None = None) -> None:
        self._auth = BearerAuth(token, "EngineControl.token", "engine control")
        if isinstance(max_pause_s, bool) or not isinstance(max_pause_s, int | float) or not max_pause_s > 0:
            raise ConfigError("EngineControl.max_pause_s", f"must be > 0 (math.inf: no lease), got {max_pause_s!r}")
        self.max_pause_s = max_pause_s  # a pause with no resume or weights post for this long is undone
        # When set, posted weight paths must lie under it (403 otherwise); None trusts the token holder.
        self.weights_root = Path(weights_root).resolve() if weights_root is not None else None
        self.counters: Counter[str] = Counter()  # requests by route and HTTP status
        self._engine: Engine | None = None
        self._absent = "engine not started yet"  # the 503 while no engine is attached
        self._lock = asyncio.Lock()  # one control call at a time
        self._lease: asyncio.Task[None] | None = None  # the current lease
        self._leases = TaskOwner("asyncrl-pause-lease")  # every lease task not finished yet
        self._unpaused = asyncio.Event()  # clear while a pause is held
        self._unpaused.set()
        self._prepared: WeightUpdate | None = None  # what ``prepare`` readied for the next load
        self._detaching = False  # a detach is waiting for the pause to end: no new pause may start
        self._why_gone = STOPPING  # why the engine is being (or was) detached
        if engine is not None:
            self.attach(engine)

    @property
    def engine(self) -> Engine | None:
        """The engine under control; None until ``attach`` and after ``detach`` (calls answer 503)."""
        return self._engine

    @property
    def paused(self) -> bool:
        """A pause is held: asked for, and neither resumed nor expired yet."""
        return not self._unpaused.is_set()

    def attach(self, engine: Engine) -> None:
        """Put ``engine`` under control: the routes go live."""
        if engine is not self._engine:
            self._release_prepared()  # prepared by the previous engine, which holds its staged copy
        self._engine = engine
        self._detaching = False

    async def detach(self, release_timeout_s: float = RELEASE_TIMEOUT_S, why: str = STOPPING) -> Engine | None:
        """Take the engine out of control once no pause is held, and return it (None if none was attached).

        Waits up to ``release_timeout_s`` for a held pause to end (the learner resumes, or the lease expires);
        past that the service resumes the engine itself. Meanwhile a new pause is refused (503), and once
        detached every call answers 503 "engine closed: {why}"."""
        engine = self._engine
        if engine is None:
            return None
        self._detaching, self._why_gone = True, why
        if self.paused and release_timeout_s > 0:
            try:
                await asyncio.wait_for(self._unpaused.wait(), release_timeout_s)
            except TimeoutError:
                log.warning("engine control: pause still held after %.1fs; resuming before detaching",
                            release_timeout_s)
        async with self._lock:  # no control call is half-way through past this point
            self._cancel_lease()
            if self.paused:
                await self._resume_quietly(engine, "before detaching")
            self._release_prepared()
            self._engine = None
            self._absent = f"engine closed: {why}"
        await self._leases.aclose()  # cancelled above: their ends, awaited
        return engine

    @contextlib.asynccontextmanager
    async def serving(self, engine: Engine, release_timeout_s: float = RELEASE_TIMEOUT_S) -> AsyncIterator[Engine]:
        """Attach ``engine`` for the body; on the way out, however it ends, ``detach`` it (waiting for a held
        pause to end first, even while being cancelled). The engine is the caller's to close afterwards. The
        503s that follow say how the body ended: finished, failed, or cancelled (the service stopping)."""
        self.attach(engine)
        why = STOPPING
        try:
            yield engine
            why = FINISHED
        except Exception as exc:
            why = f"the rollouts failed ({type(exc).__name__}); the service keeps serving"
            raise
        finally:
            await settle(self.detach(release_timeout_s, why), "detaching the engine from its control routes")

    async def close(self) -> None:
        """Detach without waiting: a held pause is resumed now, a prepared update released. Idempotent."""
        await self.detach(release_timeout_s=0)
        await self._leases.aclose()  # started after a detach (by a call that was already past the lock)

    def routes(self, prefix: str = CONTROL_PREFIX) -> list[web.RouteDef]:
        prefix = prefix.rstrip("/")
        return [
            self._route("POST", prefix, "prepare", self._prepare),
            self._route("POST", prefix, "pause", self._pause),
            self._route("POST", prefix, "resume", self._resume),
            self._route("POST", prefix, "weights", self._weights),
            self._route("GET", prefix, "version", self._version),
            self._route("GET", prefix, "health", self._health, auth=False),
        ]

    def metrics(self) -> dict[str, float]:
        return {f"control/{key}": value for key, value in sorted(self.counters.items())} | {
            "control/paused": float(self.paused)}

    def _route(self, method: str, prefix: str, name: str, action: Action, auth: bool = True) -> web.RouteDef:
        async def act(request: web.Request) -> dict[str, Any]:
            engine = self._engine
            if engine is None:
                raise HTTPError(503, self._absent)
            return await action(engine, request)

        def count(status: int) -> None:
            self.counters[f"{name}_{status}"] += 1

        handler = json_endpoint(act, auth=self._auth if auth else None, errors=_engine_errors, on_reply=count)
        return web.route(method, f"{prefix}/{name}", handler)

    @contextlib.asynccontextmanager
    async def _holding(self, engine: Engine) -> AsyncIterator[None]:
        """The control lock, for a call on ``engine``: 503 if it was detached while the call waited."""
        async with self._lock:
            if self._engine is not engine:
                raise HTTPError(503, self._absent)
            yield

    # -- actions

    async def _pause(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await read_json_object(request, {"mode": str, "clear_cache": bool})
        try:
            mode = PauseMode(body["mode"])
        except ValueError:
            raise bad_request("mode", f"must be one of {[m.value for m in PauseMode]}, got {body['mode']!r}") from None
        async with self._holding(engine):
            if self._detaching:  # the pause held now is the last one: the engine is about to go
                raise HTTPError(503, f"engine closing: {self._why_gone}")
            await engine.pause(mode, body["clear_cache"])
            self._unpaused.clear()
            self._start_lease(engine)
        return {"paused": True, "version": engine.version}

    async def _resume(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        async with self._holding(engine):
            self._cancel_lease()
            try:
                await engine.resume()
            finally:  # the learner has let go of its pause either way
                self._unpaused.set()
                self._release_prepared()
        return {"paused": False, "version": engine.version}

    async def _prepare(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await read_json_object(request, {"version": int, "path": str})
        update = await self._read_update(body)
        async with self._holding(engine):
            self._release_prepared()
            self._prepared = await engine.prepare(update)  # checks + staging, generation still running
        return {"prepared": update.version}

    async def _weights(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        body = await read_json_object(request, {"version": int, "path": str}, optional=("path",))
        t0 = time.perf_counter()
        update = await self._read_update(body) if "path" in body else None
        async with self._holding(engine):
            if update is not None:
                update = await engine.prepare(update)
            else:
                update = self._take_prepared(body["version"])
            try:
                await engine.load(update)
            finally:
                engine.release(update)
            if self.paused:
                self._start_lease(engine)  # the load took time out of the lease; give the resume a full one
        log.info("engine control: loaded v%d in %.2fs", engine.version, time.perf_counter() - t0)
        return {"version": engine.version}

    def _take_prepared(self, version: int) -> WeightUpdate:
        update = self._prepared
        if update is None or update.version != version:
            raise WeightUpdateError(f"no prepared update for version {version} (prepared: "
                                    f"{update.version if update else None}); prepare it first")
        self._prepared = None
        return update

    async def _version(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        return {"version": engine.version, "max_model_len": engine.max_model_len, "name": engine.name,
                "paused": self.paused}

    async def _health(self, engine: Engine, request: web.Request) -> dict[str, Any]:
        await engine.check_alive()  # EngineError -> 503
        return {"ok": True}

    # -- weights from files

    async def _read_update(self, body: dict[str, Any]) -> WeightUpdate:
        if body["version"] < 0:
            raise bad_request("version", f"must be >= 0, got {body['version']}")
        tensors = await asyncio.to_thread(_read_tensors, self._weights_dir(body["path"]))
        return WeightUpdate(body["version"], InMemory(tensors))

    def _weights_dir(self, given: str) -> Path:
        path = Path(given)
        if not path.is_absolute():
            raise bad_request("path", f"must be absolute, got {given!r}")
        if self.weights_root is not None and not path.resolve().is_relative_to(self.weights_root):
            raise HTTPError(403, f"path: {given!r} is outside the service's weights_root", field="path")
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise bad_request("path", f"{given!r} is not a directory holding *.safetensors files "
                                      f"(is it on a filesystem this service can read?)")
        return path

    def _release_prepared(self) -> None:
        update, self._prepared = self._prepared, None
        if update is not None and self._engine is not None:
            self._engine.release(update)

    # -- the pause lease

    def _start_lease(self, engine: Engine) -> None:
        self._cancel_lease()
        if math.isfinite(self.max_pause_s):
            self._lease = self._leases.start(self._expire(engine))

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
            await self._resume_quietly(engine, "after an expired pause")

    async def _resume_quietly(self, engine: Engine, when: str) -> None:
        try:
            await engine.resume()
        except Exception:
            log.exception("engine control: resume %s failed", when)
        finally:
            self._unpaused.set()
            self._release_prepared()


def engine_control_routes(engine: Engine, token: str, prefix: str = CONTROL_PREFIX,
                          **kwargs: Any) -> list[web.RouteDef]:
    """The control routes for ``engine`` (``app.add_routes(...)``); ``kwargs`` go to ``EngineControl``.

    Use ``EngineControl`` itself when the engine starts after the app (routes must exist before the app
    starts), or to detach the engine in order when the service stops."""
    return EngineControl(engine, token, **kwargs).routes(prefix)


def _read_tensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    try:
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    except (OSError, SafetensorError) as exc:
        raise bad_request("path", f"cannot read weights from {path}: {exc}") from None
    return tensors
