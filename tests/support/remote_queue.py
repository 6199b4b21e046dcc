"""Helpers shared by the remote rollout queue tests (not fixtures): a group that exercises every wire field, an
ingest server in front of a real queue, and client-side events to wait on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from asyncrl.config import QueueConfig
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer
from asyncrl.queues.rollout_queue import RolloutReceiver, create_rollout_queue
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan
from asyncrl.versions import VersionClock

TOKEN = "s3cret-token"
WAIT_S = 5.0  # upper bound on any awaited event; tests finish far sooner


def make_group(gid: str = "g0", *, n: int = 2, tokens: int = 4) -> RolloutGroup:
    """A group whose rollouts span two weight versions (3 then 4), so staleness and spans are exercised."""
    prompt = Prompt(f"p-{gid}", (1, 2, 3), text="2+2=", answer={"value": 4, "alts": ["four", None], "ok": True})
    half = tokens // 2
    rollouts = tuple(
        Rollout(Sample(token_ids=tuple(range(10 + i, 10 + i + tokens)),
                       logprobs=tuple(-0.1 * (k + 1) - i for k in range(tokens)),
                       finish_reason=FinishReason.STOP if i % 2 == 0 else FinishReason.LENGTH,
                       version_spans=(VersionSpan(3, 0, half), VersionSpan(4, half, tokens)),
                       text=f"completion {i}"),
                reward=float(i) - 0.5)
        for i in range(n)
    )
    return RolloutGroup(gid, prompt, rollouts, meta={"producer": "p0", "staleness_tag": 1})


@asynccontextmanager
async def serve(capacity: int = 8, version: int = 4,
                **cfg: Any) -> AsyncIterator[tuple[RolloutReceiver, RolloutIngestServer]]:
    """An ingest server feeding a queue whose clock serves ``version``; yields the receiving end and the server."""
    config = QueueConfig(capacity=capacity, max_staleness=1)
    sender, receiver = create_rollout_queue(config, VersionClock(version))
    async with RolloutIngestServer(sender, IngestServerConfig(token=TOKEN, **cfg),
                                   queue_metrics=receiver.metrics) as server:
        yield receiver, server


def trace_events() -> tuple[aiohttp.TraceConfig, dict[str, asyncio.Event]]:
    """Events set by the client session when a 503 arrives, a request fails in transport, or one starts."""
    events = {"503": asyncio.Event(), "error": asyncio.Event(), "start": asyncio.Event()}
    trace = aiohttp.TraceConfig()

    async def on_start(session: Any, ctx: Any, params: Any) -> None:
        events["start"].set()

    async def on_end(session: Any, ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        if params.response.status == 503:
            events["503"].set()

    async def on_exception(session: Any, ctx: Any, params: Any) -> None:
        events["error"].set()

    trace.on_request_start.append(on_start)
    trace.on_request_end.append(on_end)
    trace.on_request_exception.append(on_exception)
    return trace, events


def _sample0(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["rollouts"][0]["sample"]
