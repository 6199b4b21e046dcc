"""The learner's side of an engine embedded in another service: a ``WeightTarget`` and ``Lifecycle`` over
the ``EngineControl`` routes (``server.py``).

``RemoteControlEngine`` lets the standard ``WeightSync`` and ``Learner`` publish into the embedded engine:
``prepare`` refuses an adapter (the service's engine takes full weights), checks the update against
``model_dir``'s parameters, stages it as files (``stage_as_files``) under ``staging_dir`` (default ``/dev/shm``;
the service must be able to read it), has the service read and prepare it while generation runs, and removes the
staged directory once answered; ``load`` then only asks the paused service to load it. It never samples:
producers live next to the engine, in the service.

Shutdown, the learner's side of the handshake: ``Learner.run`` returns (or raises) only once its last
publication has resumed the engine or failed with an error naming the call (``ControlError``, or
``WeightUpdateError`` for a refused update); only then may the learner close its rollout queue, which is
what ends the service's producer and, after it, the service's engine (see ``queues/ingest_server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.engines.embedded.server import CONTROL_PREFIX
from asyncrl.engines.protocols import Lifecycle, StagedInEngine, WeightTarget, WeightUpdate
from asyncrl.engines.transports.base import FULL_ONLY
from asyncrl.engines.transports.files import stage_as_files
from asyncrl.engines.updates import check_kind
from asyncrl.engines.weights import manifest_dtype, read_manifest, staging_root
from asyncrl.errors import ConfigError, EngineError, WeightUpdateError
from asyncrl.http.client import JSONClient, TransportError
from asyncrl.types import PauseMode

log = logging.getLogger(__name__)

__all__ = ["ControlError", "RemoteControlEngine"]


class ControlError(EngineError):
    """A control call failed: the service answered ``status`` (401, 503, ...) or, with None, was unreachable."""

    def __init__(self, engine: str, message: str, status: int | None) -> None:
        super().__init__(engine, message)
        self.status = status


class RemoteControlEngine(WeightTarget, Lifecycle):
    """``WeightTarget`` + ``Lifecycle`` of an engine embedded in another process, over HTTP.

    ``version`` is the engine's as of the last control call (``refresh`` reads it again)."""

    def __init__(self, url: str, token: str, model_dir: str | Path, *, prefix: str = CONTROL_PREFIX,
                 staging_dir: str | Path | None = None, timeout_s: float = 120.0, health_timeout_s: float = 5.0,
                 name: str | None = None) -> None:
        owner = type(self).__name__
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{owner}.url", f"must be an http(s) URL, got {url!r}")
        if staging_dir is not None and not Path(staging_dir).is_dir():
            raise ConfigError(f"{owner}.staging_dir", f"{staging_dir!r} is not a directory")
        if isinstance(health_timeout_s, bool) or not isinstance(health_timeout_s, int | float) \
                or not health_timeout_s > 0:
            raise ConfigError(f"{owner}.health_timeout_s", f"must be > 0, got {health_timeout_s!r}")
        self._http = JSONClient(url.rstrip("/") + "/" + prefix.strip("/"), token, owner=owner, timeout_s=timeout_s)
        self.name = name or f"control:{url}"
        self._manifest = read_manifest(model_dir)  # raises if model_dir has no *.safetensors
        self._dtype = manifest_dtype(self._manifest)
        self._staging_root = Path(staging_dir) if staging_dir is not None else staging_root()
        self._health_timeout_s = health_timeout_s
        self._version = 0
        self._prepared: int | None = None  # the version the service holds prepared for us

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}({self._http.base_url!r})"

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
        return self._version

    async def refresh(self) -> int:
        """GET the engine's version from the service."""
        reply = await self._call("GET", "/version")
        self._version = int(reply["version"])
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
                log.info("waiting for the engine behind %s: %s", self._http.base_url, exc)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    # -- WeightTarget

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Validate and stage here (a bad update is refused before anything is sent), then have the service
        read and prepare it. The staged directory is removed once the service has answered."""
        self._prepared = None
        check_kind(self.name, "embedded engine's control routes", FULL_ONLY, update)
        staged = (await stage_as_files(update, self._manifest, self._dtype, self._staging_root)).staged
        try:
            await self._call("POST", "/prepare", {"version": update.version, "path": str(staged.path)})
        finally:
            staged.release()  # the service has read the tensors (or failed to)
        self._prepared = update.version
        return replace(update, staged=StagedInEngine(update.version))  # held by the service's engine

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._call("POST", "/pause", {"mode": PauseMode(mode).value, "clear_cache": clear_cache})

    async def load(self, update: WeightUpdate) -> None:
        if update.staged != StagedInEngine(update.version) or self._prepared != update.version:
            raise WeightUpdateError(f"engine {self.name}: version {update.version} was not prepared")
        self._prepared = None
        try:
            reply = await self._call("POST", "/weights", {"version": update.version})
        except ControlError as exc:
            if exc.status is not None or await self._version_or_none() != update.version:
                raise
            log.warning("%s: the answer to the weights post was lost, but the engine reports v%d", self.name,
                        update.version)
            reply = {"version": update.version}
        self._version = int(reply["version"])

    async def resume(self) -> None:
        await self._call("POST", "/resume", {})

    def release(self, update: WeightUpdate) -> None:
        # Nothing is held here (the staged directory went once the service read it). The service releases
        # its prepared copy itself: once loaded, at the next prepare, or at the publication's resume.
        if self._prepared == update.version:
            self._prepared = None

    # -- Lifecycle

    async def check_alive(self) -> None:
        try:
            await self._call("GET", "/health", timeout_s=self._health_timeout_s)
        except ControlError as exc:
            raise EngineError(self.name, f"failed its health check: {exc}") from exc

    async def close(self) -> None:
        """Close the HTTP session. The engine belongs to the service and keeps running. Idempotent."""
        await self._http.close()

    # -- internals

    async def _version_or_none(self) -> int | None:
        try:
            return await self.refresh()
        except ControlError:
            return None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        if self._http.closed:
            raise EngineError(self.name, "engine client is closed")
        url = self._http.base_url + path
        try:
            reply = await self._http.call(method, path, body, timeout_s=timeout_s)
        except TransportError as exc:
            raise ControlError(self.name, str(exc), None) from exc
        if reply.ok:
            return reply.body
        message = f"{method} {url}: HTTP {reply.status}: {reply.error}"
        if reply.status == 409:
            raise WeightUpdateError(f"engine {self.name}: {message}")
        raise ControlError(self.name, message, reply.status)
