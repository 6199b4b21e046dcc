"""An Engine wrapper that restarts a dead engine and brings it back to the last published weights.

Without it, a dead engine stops the pipeline with an ``EngineError`` naming it (the pipeline's watchdog awaits the
engine's death event). With it, that event starts the restart too (``wait_dead``), and the first caller to see the
death starts a replacement from ``factory``, reloads the last successful ``WeightUpdate`` (so the version and
weights are what the learner last published), and retries the failed call once. Requests that were in flight on the
dead engine are sampled again on the new one, so their groups are not lost.

Memory: the last update's tensors are kept as a CPU copy (one extra copy of the model). The copy is made in a
worker thread while preparing, before generation pauses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence


from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import BehaviourPrecision, Engine, EngineError, WeightUpdate
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[Engine]]


class SupervisedEngine(Engine):
    def __init__(self, inner: Engine, factory: EngineFactory, *, max_restarts: int = 1,
                 close_timeout_s: float = 15.0) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self._inner = inner
        self._factory = factory
        self.max_restarts = max_restarts
        self.close_timeout_s = close_timeout_s  # bound on closing a dead engine before replacing it
        self.restarts = 0
        self.name = f"supervised({inner.name})"
        self._lock = asyncio.Lock()
        self._last_update: WeightUpdate | None = None  # CPU copy of the last loaded update
        # Prepared updates by version: the member that prepared it, and a CPU copy for a replacement engine.
        self._copies: dict[int, tuple[Engine, WeightUpdate]] = {}
        self._closed = False

    @classmethod
    async def start(cls, factory: EngineFactory, *, max_restarts: int = 1) -> SupervisedEngine:
        return cls(await factory(), factory, max_restarts=max_restarts)

    @property
    def inner(self) -> Engine:
        return self._inner

    @property
    def version(self) -> int:
        return self._inner.version

    @property
    def max_model_len(self) -> int:
        return self._inner.max_model_len

    @property
    def behaviour_precision(self) -> BehaviourPrecision | None:
        return self._inner.behaviour_precision

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        engine = self._inner
        try:
            return await engine.generate(prompt_ids, params, request_id, n)
        except EngineError:
            await self._recover(engine)
            return await self._inner.generate(prompt_ids, params, f"{request_id}/restart{self.restarts}", n)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._with_recovery(lambda e: e.pause(mode, clear_cache))

    async def resume(self) -> None:
        await self._with_recovery(lambda e: e.resume())

    async def score(self, token_ids: Sequence[int]) -> Mapping[str, list[float]]:
        return await self._inner.score(token_ids)

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        inner = self._inner
        prepared = await inner.prepare(update)
        try:
            copy = await asyncio.to_thread(update.source.detached)
        except BaseException:
            inner.release(prepared)
            raise
        self._copies[update.version] = (inner, WeightUpdate(update.version, copy))
        return prepared

    async def load(self, update: WeightUpdate) -> None:
        prepared_on, copy = self._copies[update.version]
        # On the engine that prepared it, load as prepared; on a replacement, prepare the CPU copy first.
        await self._with_recovery(lambda e: e.load(update) if e is prepared_on else _prepare_and_load(e, copy))
        self._last_update = copy

    def release(self, update: WeightUpdate) -> None:
        prepared_on, _ = self._copies.pop(update.version, (self._inner, None))
        prepared_on.release(update)

    @property
    def sleep_level(self) -> int:
        return self._inner.sleep_level

    async def sleep(self, level: int | None = None) -> None:
        # A replacement starts awake: it is put to sleep like the engine it replaced.
        await self._with_recovery(lambda e: e.sleep(level))

    async def wake(self) -> None:
        await self._with_recovery(lambda e: e.wake())

    async def check_alive(self) -> None:
        await self._with_recovery(lambda e: e.check_alive())

    async def wait_dead(self) -> EngineError:
        """Restart the engine each time it dies (the death event of the one in charge is awaited); return once
        that fails: the budget is spent, or the supervisor was closed."""
        while True:
            engine = self._inner
            await engine.wait_dead()
            try:
                await self._recover(engine)
            except EngineError as exc:
                return exc

    async def _with_recovery(self, call: Callable[[Engine], Awaitable[None]]) -> None:
        engine = self._inner
        try:
            await call(engine)
        except EngineError:
            await self._recover(engine)
            await call(self._inner)

    async def _recover(self, failed: Engine) -> None:
        async with self._lock:
            if self._inner is not failed:
                return  # another caller already replaced it
            if self._closed:
                raise EngineError(failed.name, "engine was closed")
            if self.restarts >= self.max_restarts:
                raise EngineError(failed.name, f"engine died and the restart budget ({self.max_restarts}) "
                                               f"is spent")
            log.error("engine %s died; restarting (%d of %d)", failed.name, self.restarts + 1, self.max_restarts)
            await self._close_quietly(failed)
            fresh = await self._factory()
            if self._last_update is not None:
                await _prepare_and_load(fresh, self._last_update)
            self._inner = fresh
            self.restarts += 1
            log.warning("engine restarted as %s at version %d", fresh.name, fresh.version)

    async def _close_quietly(self, engine: Engine) -> None:
        try:
            async with asyncio.timeout(self.close_timeout_s):
                await engine.close()
        except Exception as exc:  # it is already dead; we only want its processes gone
            log.warning("closing dead engine %s failed: %r", engine.name, exc)

    async def close(self) -> None:
        self._closed = True
        await self._inner.close()


async def _prepare_and_load(engine: Engine, update: WeightUpdate) -> None:
    prepared = await engine.prepare(update)
    try:
        await engine.load(prepared)
    finally:
        engine.release(prepared)
