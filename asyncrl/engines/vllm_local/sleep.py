"""Sleep/wake: the transport of an in-process engine that gives its GPU memory to a colocated learner while it
trains (``VLLMEngineConfig.sleep``).

``sleep`` pauses the engine (``keep``: nothing in flight is lost, it is recomputed after the wake) and frees its
GPU memory at vLLM's level (1 keeps a host copy of the weights, 2 keeps nothing). The wake-up order is the one
vLLM's RL examples and TRL's colocate mode use: weights first (``wake_up(tags=["weights"])``), then the update is
loaded, then the KV cache (``["kv_cache"]``); vLLM resumes scheduling once both are resident.

It wraps the engine's awake transport (files or CUDA IPC) and takes over while the engine sleeps: ``stage``
packs a CUDA IPC update without staging it into shadow parameters (nothing generates, so it can go straight into
the live ones, and the shadows would take the memory sleeping freed), ``load`` wakes the weights and loads,
``resume`` wakes the KV cache. ``wake()`` wakes without an update: the weights slept with at level 1; at level 2,
whose weights are gone, the last loaded files where the engine publishes through files, else it refuses
(``WeightUpdateError``): publish an update instead.

On CPU vLLM's sleep only pauses the scheduler; the same calls run and free nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from asyncrl.engines.transports.base import Transport, WeightTransport
from asyncrl.engines.updates import UpdateKind, WeightUpdate
from asyncrl.engines.vllm_local.ipc import Rpc, free_snapshot, pack_update
from asyncrl.engines.weights import ParamSpec
from asyncrl.errors import EngineError, WeightUpdateError
from asyncrl.types import PauseMode

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SleepCounters:
    sleeps: int = 0
    sleep_s: float = 0.0  # total time falling asleep (seconds)
    wake_s: float = 0.0  # total time in wake_up calls, weights and KV cache (seconds)


@dataclass(frozen=True, slots=True)
class _Packed:
    """An update packed for the workers while the engine sleeps; loaded by ``load``, freed by ``release``."""

    flat: Any  # the snapshot buffer the payload's IPC handle points into
    payload: bytes


@dataclass(frozen=True, slots=True)
class _Staged:
    """``WeightUpdate.staged`` of a ``SleepTransport``: which way it was staged, and so which way it loads."""

    packed: _Packed | None  # packed for a direct load into the woken weights; None: staged by the awake transport
    awake: Any = None  # the awake transport's own handle (with ``packed`` None)


@dataclass(frozen=True, slots=True)
class SleepControl:
    """The engine's calls sleeping needs (each raced against the engine's death)."""

    sleep: Callable[[int, str], Awaitable[Any]]  # vLLM's AsyncLLM.sleep(level, mode)
    wake_up: Callable[[list[str] | None], Awaitable[Any]]  # AsyncLLM.wake_up(tags)
    drain: Callable[[], Awaitable[None]]  # until outputs produced before the pause reached their streams
    rpc: Rpc


class AwakeTransport(WeightTransport, Protocol):
    """What sleeping needs of the transport it wraps (files and CUDA IPC play it)."""

    # While asleep, stage by packing for a direct load into the woken live weights (CUDA IPC), instead of
    # staging as usual (files: the reload needs nothing resident).
    direct_while_asleep: bool

    async def before_sleep(self) -> None:
        """Free what vLLM's sleep would not (CUDA IPC's shadows)."""
        ...

    async def reload_last(self) -> None:
        """Load the last weights loaded again, into weights a deep sleep discarded; ``WeightUpdateError`` where
        they are not kept."""
        ...


class SleepTransport(Transport):
    """The awake transport, plus what sleeping changes; owns the engine's sleep state."""

    kind = "sleep"

    def __init__(self, engine: str, awake: AwakeTransport, control: SleepControl,
                 manifest: Mapping[str, ParamSpec], dtype: torch.dtype) -> None:
        self._engine = engine
        self._awake = awake
        self._control = control
        self._manifest = manifest
        self._dtype = dtype
        self._level = 0  # the level slept at; 0 = awake
        self._weights_resident = True  # weights mapped in GPU memory
        self._weights_lost = False  # level 2: discarded and not loaded again yet
        self.counters = SleepCounters()

    @property
    def accepts(self) -> frozenset[UpdateKind]:
        return self._awake.accepts

    @property
    def asleep(self) -> bool:
        return self._level > 0

    async def sleep(self, level: int) -> None:
        """Pause and free the GPU memory at ``level``. No-op when asleep."""
        if self._level:
            return
        t0 = time.perf_counter()
        await self._awake.before_sleep()
        await self._control.sleep(level, PauseMode.KEEP.value)
        await self._control.drain()
        self._level, self._weights_resident, self._weights_lost = level, False, level == 2
        self.counters.sleeps += 1
        self.counters.sleep_s += time.perf_counter() - t0

    async def wake(self) -> None:
        """Wake fully without an update (see the module docstring for level 2). No-op when awake."""
        if not self._level:
            return
        if self._weights_lost:
            await self._wake_weights()
            await self._awake.reload_last()
            self._weights_lost = False
        await self._wake_rest()

    async def resume(self) -> bool:
        """Wake the KV cache after a load (vLLM then resumes scheduling). False where the engine is awake."""
        if not self._level:
            return False
        if self._weights_lost:  # a failed load: generating now would sample from discarded weights
            log.error("engine %s stays asleep: its weights were not loaded", self._engine)
            return True
        await self._wake_rest()
        return True

    # -- the three phases --------------------------------------------------------------------------------------

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        if not (self._level and self._awake.direct_while_asleep):
            staged = await self._awake.stage(update)
            return replace(staged, staged=_Staged(None, staged.staged))
        flat, payload = await pack_update(update, self._manifest, self._dtype)
        return replace(update, staged=_Staged(_Packed(flat, payload)))

    async def load(self, update: WeightUpdate) -> None:
        if self._level:
            await self._wake_weights()
        packed = _staged(self._engine, update).packed
        if packed is None:
            await self._awake.load(_as_awake(update))
            self._weights_lost = False
            return
        try:
            await self._control.rpc("asyncrl_load_ipc", packed.payload)
        except EngineError:
            raise
        except Exception as exc:  # the live weights may be half-written: the engine stays asleep until an update
            self._weights_lost = True
            raise WeightUpdateError(f"engine {self._engine}: loading version {update.version} into the woken "
                                    f"weights failed ({exc!r}); it stays asleep until an update loads") from exc
        self._weights_lost = False

    def release(self, update: WeightUpdate) -> None:
        if update.staged is None:
            return
        if update.staged.packed is not None:
            free_snapshot()
        else:
            self._awake.release(_as_awake(update))

    async def close(self) -> None:
        await self._awake.close()

    # -- waking ------------------------------------------------------------------------------------------------

    async def _wake_weights(self) -> None:
        if not self._weights_resident:
            await self._timed_wake(["weights"])
            self._weights_resident = True

    async def _wake_rest(self) -> None:
        await self._timed_wake(["kv_cache"] if self._weights_resident else None)
        self._level, self._weights_resident = 0, True

    async def _timed_wake(self, tags: list[str] | None) -> None:
        t0 = time.perf_counter()
        await self._control.wake_up(tags)
        self.counters.wake_s += time.perf_counter() - t0


def _staged(engine: str, update: WeightUpdate) -> _Staged:
    if update.staged is None:
        raise WeightUpdateError(f"engine {engine}: version {update.version} was not prepared")
    return update.staged


def _as_awake(update: WeightUpdate) -> WeightUpdate:
    """``update`` as the awake transport staged it."""
    return replace(update, staged=update.staged.awake)
