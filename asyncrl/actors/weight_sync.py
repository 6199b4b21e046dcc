"""Publishing the learner's weights into the engine: lock -> pause -> update -> finally resume.

The version moves only when the update fully succeeded; resume always runs, shielded from cancellation, so a
failed or cancelled sync never leaves generation paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping

import torch

from asyncrl.config import SyncConfig
from asyncrl.engines.base import Engine, PreparesUpdates, WeightUpdate
from asyncrl.types import SyncTiming

log = logging.getLogger(__name__)


class WeightSync:
    """Serialises weight publications to one engine (or an engine pool)."""

    def __init__(self, engine: Engine, config: SyncConfig) -> None:
        self.engine = engine
        self.config = config
        self._lock = asyncio.Lock()
        self.history: deque[SyncTiming] = deque(maxlen=1000)  # recent successful publications
        self.count = 0  # successful publications
        self.total_s = 0.0  # total time generation was paused for them (seconds)
        self.failures = 0

    async def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> SyncTiming:
        """Make ``tensors`` the engine's weights, tagged ``version``. Raises if the update failed."""
        mode, clear = self.config.mode, self.config.clear_cache
        async with self._lock:
            t_prep = time.perf_counter()
            update = await self._prepare(WeightUpdate(version=version, tensors=tensors))
            t0 = time.perf_counter()
            try:
                await self.engine.pause(mode, clear)
                t1 = time.perf_counter()
                try:
                    await self.engine.update_weights(update)
                    t2 = time.perf_counter()
                finally:
                    t_resume = time.perf_counter()
                    await asyncio.shield(self.engine.resume())
                    t3 = time.perf_counter()
            except BaseException:
                self.failures += 1
                if isinstance(self.engine, PreparesUpdates):
                    self.engine.discard_update(update)
                raise
        timing = SyncTiming(version=version, pause_s=t1 - t0, transfer_s=t2 - t1, resume_s=t3 - t_resume,
                            total_s=t3 - t0, mode=mode, clear_cache=clear, prepare_s=t0 - t_prep)
        self.history.append(timing)
        self.count += 1
        self.total_s += timing.total_s
        log.info("published v%d: pause %.3fs transfer %.3fs resume %.3fs", version, timing.pause_s,
                 timing.transfer_s, timing.resume_s)
        return timing

    async def _prepare(self, update: WeightUpdate) -> WeightUpdate:
        # Checks and serialisation happen before the pause, so generation stops only for the load.
        if isinstance(self.engine, PreparesUpdates):
            return await self.engine.prepare_update(update)
        return update

    def metrics(self) -> dict[str, float]:
        if not self.history:
            return {"sync/count": 0, "sync/failures": self.failures}
        last = self.history[-1]
        return {
            "sync/count": self.count, "sync/failures": self.failures, "sync/pause_s": last.pause_s,
            "sync/transfer_s": last.transfer_s, "sync/prepare_s": last.prepare_s, "sync/resume_s": last.resume_s,
            "sync/total_s": last.total_s,
        }
