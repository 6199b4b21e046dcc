"""vLLM sleep mode for ``VLLMEngine``: give the GPU memory to a colocated learner while it trains.

``await engine.sleep()`` pauses the engine (``keep``: nothing in flight is lost, it is recomputed after the wake)
and frees its GPU memory at ``VLLMEngineConfig.sleep``'s level (vLLM's levels: 1 keeps a host copy of the
weights, 2 keeps nothing). The wake-up order is the one vLLM's RL examples and TRL's colocate mode use:
weights first (``wake_up(tags=["weights"])``), then the update is loaded, then the KV cache (``["kv_cache"]``);
vLLM resumes scheduling once both are resident.

WeightSync drives a sleeping engine through the unchanged ``WeightTarget`` calls: ``prepare`` validates and
packs the update (CUDA IPC) without staging it into shadow parameters (nothing generates, so it can go straight
into the live ones, and the shadows would take the memory sleeping freed), ``pause`` has nothing left to do,
``load`` wakes the weights and loads, ``resume`` wakes the KV cache. ``wake()`` wakes without an update: the
weights slept with at level 1; at level 2, whose weights are gone, the last loaded files where the engine
publishes through files, else it refuses (``WeightUpdateError``): publish an update instead.

On CPU vLLM's sleep only pauses the scheduler; the same calls run and free nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.engines.protocols import StagedInEngine, WeightUpdate
from asyncrl.engines.vllm_local.ipc import free_snapshot, pack_update
from asyncrl.errors import EngineError, WeightUpdateError
from asyncrl.types import PauseMode

if TYPE_CHECKING:
    from asyncrl.engines.vllm_local.config import VLLMEngineConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SleepCounters:
    sleeps: int = 0
    sleep_s: float = 0.0  # total time falling asleep (seconds)
    wake_s: float = 0.0  # total time in wake_up calls, weights and KV cache (seconds)


@dataclass(slots=True)
class _Packed:
    """An update packed for the workers while the engine sleeps; loaded by ``load``, freed by ``release``."""

    flat: Any  # the snapshot buffer the payload's IPC handle points into
    payload: bytes


class SleepMixin:
    """The sleep half of ``VLLMEngine`` (which provides the attributes declared here)."""

    # Also from VLLMEngine: _raise_if_dead, _call, _drain_outputs, _reload, _set_version, _manifest, _dtype.
    name: str
    _cfg: VLLMEngineConfig
    _llm: Any
    _ipc: bool
    _good: Any

    def _init_sleep(self) -> None:
        self._asleep = 0  # the level slept at; 0 = awake
        self._weights_resident = True  # weights mapped in GPU memory
        self._weights_lost = False  # level 2: discarded and not loaded again yet
        self._packed: dict[int, _Packed] = {}
        self.sleep_counters = SleepCounters()

    @property
    def sleep_level(self) -> int:
        """The level ``sleep()`` uses (``VLLMEngineConfig.sleep``); 0: this engine never sleeps."""
        return self._cfg.sleep

    @property
    def asleep(self) -> bool:
        return self._asleep > 0

    async def sleep(self, level: int | None = None) -> None:
        """Pause and free the GPU memory at ``level`` (default ``VLLMEngineConfig.sleep``; 1 where a step will
        not publish, since level 2 needs an update to wake). Requests sent meanwhile wait for the wake."""
        level = self._cfg.sleep if level is None else level
        if not self._cfg.sleep:
            raise EngineError(self.name, "engine started without sleep mode (VLLMEngineConfig.sleep=0)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._raise_if_dead()
        if self._asleep:
            return
        t0 = time.perf_counter()
        if self._ipc:  # shadows live outside vLLM's pool: sleeping would not free them
            await self._call(self._llm.collective_rpc("asyncrl_release_shadows"))
        await self._call(self._llm.sleep(level, PauseMode.KEEP.value))
        await self._drain_outputs()
        self._asleep, self._weights_resident, self._weights_lost = level, False, level == 2
        self.sleep_counters.sleeps += 1
        self.sleep_counters.sleep_s += time.perf_counter() - t0

    async def wake(self) -> None:
        """Wake fully without an update (see the module docstring for level 2). No-op when awake."""
        self._raise_if_dead()
        if not self._asleep:
            return
        if self._weights_lost:
            if self._ipc:
                raise WeightUpdateError(f"engine {self.name}: sleep level 2 discarded the weights and none were "
                                        "loaded since; publish an update to wake it")
            await self._wake_weights()
            await self._reload(self._good.path)
            self._weights_lost = False
        await self._wake_rest()

    async def _wake_weights(self) -> None:
        if not self._weights_resident:
            await self._timed_wake(["weights"])
            self._weights_resident = True

    async def _wake_rest(self) -> None:
        await self._timed_wake(["kv_cache"] if self._weights_resident else None)
        self._asleep, self._weights_resident = 0, True

    async def _timed_wake(self, tags: list[str] | None) -> None:
        t0 = time.perf_counter()
        await self._call(self._llm.wake_up(tags=tags))
        self.sleep_counters.wake_s += time.perf_counter() - t0

    # -- the WeightTarget calls while asleep (VLLMEngine calls these first) ------------------------------------

    async def _prepare_asleep(self, update: WeightUpdate) -> WeightUpdate | None:
        """Pack a CUDA IPC update for ``_load_asleep``; None where the usual path applies (awake, or files)."""
        if not (self._asleep and self._ipc):
            return None
        flat, payload = await pack_update(update, self._manifest, self._dtype)
        self._packed[update.version] = _Packed(flat, payload)
        return WeightUpdate(update.version, update.tensors, staged=StagedInEngine(update.version))

    async def _load_asleep(self, update: WeightUpdate) -> bool:
        """Wake the weights and load a packed update into them. False where the usual load applies (after
        waking the weights, which it needs too)."""
        if not self._asleep:
            return False
        await self._wake_weights()
        packed = self._packed.get(update.version)
        if packed is None:
            return False
        try:
            await self._call(self._llm.collective_rpc("asyncrl_load_ipc", args=(packed.payload,)))
        except EngineError:
            raise
        except Exception as exc:  # the live weights may be half-written: the engine stays asleep until an update
            self._weights_lost = True
            raise WeightUpdateError(f"engine {self.name}: loading version {update.version} into the woken "
                                    f"weights failed ({exc!r}); it stays asleep until an update loads") from exc
        self._weights_lost = False
        await self._set_version(update.version)
        return True

    async def _resume_asleep(self) -> bool:
        """Wake the KV cache after a load (vLLM then resumes scheduling). False where the engine is awake."""
        if not self._asleep:
            return False
        if self._weights_lost:  # a failed load: generating now would sample from discarded weights
            log.error("engine %s stays asleep: its weights were not loaded", self.name)
            return True
        await self._wake_rest()
        return True

    def _release_packed(self, update: WeightUpdate) -> None:
        if self._packed.pop(update.version, None) is not None:
            free_snapshot()
