"""The remote rollout queue's shutdown handshake: a learner closing its queue and stopping the ingest server, and
what producers (between posts, silent, or parked on a full queue) hear of it.

Waiting is done on events where there are some; a post parked on a full queue in the server has none, and a
bounded poll of the queue's statistics stands in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import pytest

from asyncrl.actors.producer import Producer
from asyncrl.config import ProducerConfig, SamplingConfig
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.queues.ingest_client import RemoteQueueClient, RemoteQueueClosed, RemoteQueueError
from asyncrl.types import Prompt
from asyncrl.groups import RewardGroups
from tests.support.remote_queue import TOKEN, WAIT_S, make_group, serve, trace_events

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` for what has no event (a post parked on a full queue inside the server)."""
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"no {what} within {WAIT_S}s") from None


# ---------------------------------------------------------------- the shutdown handshake


@pytest.mark.asyncio
async def test_stop_waits_until_a_producer_between_posts_hears_the_queue_closed() -> None:
    """The learner closes its queue and stops the server while a producer is generating its next group. That
    producer's next post must be answered "queue closed". (Before the handshake the server was gone by then:
    the post met "connection refused", was retried, and ended as a RemoteQueueError, not a QueueClosed.)"""
    trace, events = trace_events()
    async with serve() as (receiver, server), aiohttp.ClientSession(trace_configs=[trace]) as session, \
            RemoteQueueClient(server.url, TOKEN, session=session, max_retries=3, backoff_s=0.01) as client:
        assert await client.send(make_group("a")) is True  # the server now knows this producer
        receiver.close()
        stopping = asyncio.create_task(server.stop())
        while not server.closed:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert server.unnotified() == [client.producer_id] and not stopping.done()
        with pytest.raises(RemoteQueueClosed):
            await client.send(make_group("b"))
        await asyncio.wait_for(stopping, WAIT_S)  # everyone told: the server stops at once, not after the grace
        assert server.unnotified() == [] and server.sender.closed
        events["start"].clear()
        with pytest.raises(RemoteQueueClosed):  # final: raised without posting to a server that is gone
            await client.send(make_group("c"))
        assert not events["start"].is_set() and not events["error"].is_set()
    assert server.counters["groups_pending"] == 1 and receiver.counters.entered == 1


@pytest.mark.asyncio
async def test_stop_waits_for_a_silent_producer_only_up_to_close_grace_s(caplog: pytest.LogCaptureFixture) -> None:
    async with serve(close_grace_s=0.2) as (receiver, server), \
            RemoteQueueClient(server.url, TOKEN, max_retries=1, backoff_s=0.01) as client:
        assert await client.send(make_group("a")) is True
        receiver.close()
        with caplog.at_level(logging.WARNING, "asyncrl.queues.ingest_server"):
            await asyncio.wait_for(server.stop(), WAIT_S)
        assert server.unnotified() == [client.producer_id]
        assert "heard that the queue closed" in caplog.text
        with pytest.raises(RemoteQueueError) as info:  # it never heard: the server is simply unreachable
            await client.send(make_group("b"))
        assert info.value.status is None and not client.queue_closed


@pytest.mark.asyncio
async def test_a_post_waiting_for_room_is_answered_closed_when_the_server_stops() -> None:
    """Stopping answers a post parked on a full queue at once, and "closed", not "full" after put_timeout_s."""
    async with serve(capacity=1, put_timeout_s=60) as (receiver, server), \
            RemoteQueueClient(server.url, TOKEN) as client:
        with server.sender.clone() as local:
            await local.send(make_group("old"))
        send = asyncio.create_task(client.send(make_group("new")))
        await until(lambda: receiver.statistics().waiting_senders == 1, "the post to wait for room")
        await asyncio.wait_for(server.stop(), WAIT_S)
        with pytest.raises(RemoteQueueClosed):
            await asyncio.wait_for(send, WAIT_S)
        assert "new" not in receiver and receiver.depth == 1


@pytest.mark.asyncio
async def test_a_producer_finishes_when_the_learner_closes_the_remote_queue() -> None:
    engine = FakeEngine()
    items = (Prompt(f"p{i}", (1, 2, 3), answer=i) for i in range(10_000))
    config = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3), max_inflight_groups=2)
    async with serve(capacity=4, version=0) as (receiver, server), RemoteQueueClient(server.url, TOKEN) as client:
        producer = Producer(engine, PromptSource(items), RewardGroups(lambda prompt, sample: 1.0), client, config)
        running = asyncio.create_task(producer.run())
        batch = await receiver.receive_batch(3)
        receiver.close()  # the learner is done
        await asyncio.wait_for(server.stop(), WAIT_S)
        await asyncio.wait_for(running, WAIT_S)  # returned: "queue closed" ends a producer, it is no failure
    assert len(batch) == 3 and client.queue_closed and server.unnotified() == []
    assert producer.counters.groups >= 3 and server.counters["groups_stored"] == producer.counters.groups
