"""Running a sharded learner: rank 0 runs the asyncio pipeline, every other rank serves its commands.

    def setup(ctx: RankContext) -> FSDPBackend: ...          # every rank: build, shard, optimiser
    async def lead(backend: FSDPBackend) -> T: ...          # rank 0: engines, pipeline, run
    run_ranks(setup, lead)                                  # under torchrun or asyncrl.launch.ray

``run_ranks`` always ends the followers: when rank 0's work returns, fails or is cancelled (SIGTERM, which
torchrun sends when another rank died) it sends them a stop (saying whether the run failed) before leaving.
``sharded_pipeline`` is ``grpo_pipeline``'s wiring around a given backend; the engines (an ``EnginePool`` of
servers, say) take its staged buckets as they are (``engines.updates.ShardedBuckets``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from asyncrl.groups.maker import GroupMaker
from asyncrl.config import PipelineConfig
from asyncrl.distributed.fsdp import FSDPBackend
from asyncrl.distributed.ranks import RankConfig, RankContext, close_ranks, init_ranks
from asyncrl.engines.protocols import Engine, WeightTarget
from asyncrl.metrics import Monitor
from asyncrl.pipeline import Pipeline
from asyncrl.data import PromptSource
from asyncrl.recipes import grpo_pipeline
from asyncrl.runtime import run
from asyncrl.types import Prompt

log = logging.getLogger(__name__)
T = TypeVar("T")
STOP_WAIT_S = 60.0  # a step in progress (up to STOP_TIMEOUT_S) plus the stop itself


def sharded_pipeline(engine: Engine, backend: FSDPBackend, prompts: Iterable[Prompt] | AsyncIterable[Prompt] |
                     PromptSource, groups: GroupMaker, config: PipelineConfig | None = None, *,
                     target: WeightTarget | None = None, monitor: Monitor | None = None, step: int = 0,
                     close_engine: bool = True) -> Pipeline:
    """Rank 0: a ``Pipeline`` whose learner trains through ``backend`` (its loss, model and optimiser) on groups
    ``groups`` makes from ``engine``'s samples, publishing through ``target`` (default: ``engine``)."""
    return grpo_pipeline(engine, None, prompts, groups, config, backend=backend, target=target,
                         monitor=monitor, step=step, close_engine=close_engine)


def run_ranks(setup: Callable[[RankContext], FSDPBackend],
              lead: Callable[[FSDPBackend], Coroutine[Any, Any, T]], config: RankConfig | None = None) -> T | None:
    """Join the ranks (with ``config``'s timeouts), build the backend on each, then rank 0 runs ``lead``
    under uvloop while the others serve. Returns ``lead``'s result on rank 0, None elsewhere."""
    result = _rank_main(init_ranks(config), setup, lead)
    close_ranks()  # nothing here holds the backend or its groups any more, so close_ranks can free them
    return result


def _rank_main(ctx: RankContext, setup: Callable[[RankContext], FSDPBackend],
               lead: Callable[[FSDPBackend], Coroutine[Any, Any, T]]) -> T | None:
    backend = setup(ctx)
    if not ctx.leader:
        backend.serve()
        return None
    return run(_leading(backend, lead))


async def _leading(backend: FSDPBackend, lead: Callable[[FSDPBackend], Coroutine[Any, Any, T]]) -> T:
    # torchrun stops the other ranks with SIGTERM when one fails: ``run`` makes it a cancellation, which unwinds
    # through here, so the followers are stopped and engines and servers close.
    try:
        result = await lead(backend)
    except BaseException as exc:
        reason = "rank 0 was cancelled" if isinstance(exc, asyncio.CancelledError) else f"rank 0 failed: {exc!r}"
        await asyncio.shield(_stop(backend, reason, failed=True))
        raise
    await _stop(backend, "the run is done", failed=False)
    return result


async def _stop(backend: FSDPBackend, reason: str, *, failed: bool) -> None:
    """``backend.stop`` in a daemon thread, waited for at most ``STOP_WAIT_S``: a follower stuck elsewhere must
    not keep rank 0 from exiting (its exit then ends the follower's collective)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def stop() -> None:
        try:
            backend.stop(reason, failed=failed)
        finally:
            loop.call_soon_threadsafe(done.set)

    threading.Thread(target=stop, name="asyncrl-stop-ranks", daemon=True).start()
    try:
        await asyncio.wait_for(done.wait(), STOP_WAIT_S)
    except TimeoutError:
        log.error("the other ranks did not take the stop within %.0fs; leaving without them", STOP_WAIT_S)
