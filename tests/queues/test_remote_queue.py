"""The rollout queue over HTTP: the ingestion server and its client, and a producer in another process (the wire
format is in test_remote_queue_wire.py, the shutdown handshake in test_remote_queue_shutdown.py).

Every server test runs a real aiohttp server on 127.0.0.1 in front of a real rollout queue (the server holds
its sending end, the test its receiving end). Waiting is done on events (aiohttp trace hooks tell us when a
response or a connection error happened), not sleeps.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncrl.config import QueueConfig
from asyncrl.errors import QueueClosed
from asyncrl.queues.ingest_client import RemoteQueueClient, RemoteQueueClosed, RemoteQueueError
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer
from asyncrl.queues.rollout_queue import RolloutReceiver, create_rollout_queue
from asyncrl.queues.wire import WireError, group_to_json
from asyncrl.types import RolloutGroup
from asyncrl.versions import VersionClock
from tests.support.remote_queue import TOKEN, WAIT_S, _sample0, make_group, serve, trace_events

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]

REPO = Path(__file__).resolve().parents[2]


async def raw_post(url: str, body: bytes | Any, *, token: str | None = TOKEN,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/groups", data=body, headers=hdrs) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


def body_of(*groups: Any) -> bytes:
    items = [group_to_json(g) if isinstance(g, RolloutGroup) else g for g in groups]
    return json.dumps({"groups": items}).encode()  # allow_nan default: lets tests send NaN on purpose


def assert_nothing_stored(receiver: RolloutReceiver) -> None:
    assert receiver.depth == 0 and receiver.counters.entered == 0


def is_group_sink(obj: Any) -> bool:
    """What a ``Producer`` needs of its sink: ``async send(group) -> bool``."""
    return inspect.iscoroutinefunction(getattr(obj, "send", None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- server + client


@pytest.mark.asyncio
async def test_round_trip_preserves_every_field_and_binds_loopback() -> None:
    sent = [make_group("a"), make_group("b", n=3, tokens=6)]
    async with serve() as (receiver, server), RemoteQueueClient(server.url, TOKEN) as client:
        assert server.url.startswith("http://127.0.0.1:")
        assert is_group_sink(client) and is_group_sink(server.sender)
        assert await client.send(sent[0]) is True
        assert await client.send_many(sent[1:]) == [True]
        got = await receiver.receive_batch(2)
    assert got == sent
    assert [g.staleness(4) for g in got] == [1, 1]


@pytest.mark.asyncio
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"])
async def test_missing_or_wrong_token_is_401_and_stores_nothing(auth: str | None) -> None:
    async with serve() as (receiver, server):
        status, body, headers = await raw_post(server.url, body_of(make_group()), token=None,
                                               headers={"Authorization": auth} if auth else None)
        assert status == 401 and "token" in body["error"] and headers["WWW-Authenticate"].startswith("Bearer")
        assert_nothing_stored(receiver)


@pytest.mark.asyncio
async def test_client_with_wrong_token_raises_and_stats_need_auth_but_health_does_not() -> None:
    async with serve() as (receiver, server):
        async with RemoteQueueClient(server.url, "nope") as client:
            with pytest.raises(RemoteQueueError) as info:
                await client.send(make_group())
        assert info.value.status == 401
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/v1/health") as resp:
                assert resp.status == 200 and (await resp.json())["ok"] is True
            async with s.get(server.url + "/v1/stats") as resp:
                assert resp.status == 401
            async with s.get(server.url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                stats = await resp.json()
        assert (stats["queue"]["queue/depth"], stats["queue"]["queue/capacity"], stats["closed"]) == (0, 8, False)
        assert (stats["counters"]["http_401"], stats["counters"]["auth_failures"]) == (1, 2)  # 1 POST, 1 GET
        assert_nothing_stored(receiver)


@pytest.mark.asyncio
async def test_oversize_body_is_413_by_content_length_and_by_streamed_size() -> None:
    big = make_group(tokens=2000)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the streamed size must be caught
        data = body_of(big)
        for i in range(0, len(data), 1024):
            yield data[i:i + 1024]

    async with serve(max_body_bytes=4096) as (receiver, server):
        status, body, _ = await raw_post(server.url, body_of(big))
        assert status == 413 and "max_body_bytes=4096" in body["error"]
        status, body, _ = await raw_post(server.url, chunked())
        assert status == 413 and "max_body_bytes=4096" in body["error"]
        async with RemoteQueueClient(server.url, TOKEN) as client:
            with pytest.raises(RemoteQueueError) as info:
                await client.send(big)
        assert info.value.status == 413
        assert_nothing_stored(receiver)


@pytest.mark.asyncio
async def test_too_many_groups_is_413_and_client_splits_requests() -> None:
    groups = [make_group(f"g{i}") for i in range(5)]
    async with serve(max_groups_per_request=2) as (receiver, server):
        status, body, _ = await raw_post(server.url, body_of(*groups[:3]))
        assert status == 413 and "max_groups_per_request=2" in body["error"]
        assert_nothing_stored(receiver)
        async with RemoteQueueClient(server.url, TOKEN, max_groups_per_request=2) as client:
            assert await client.send_many(groups) == [True] * 5
        assert receiver.depth == 5


def _bad(mutate: Callable[[dict[str, Any]], None], gid: str = "bad") -> dict[str, Any]:
    obj = group_to_json(make_group(gid))
    mutate(obj)
    return obj


BAD_REQUESTS: list[tuple[str, bytes, str]] = [
    ("malformed json", b'{"groups": [', "body: not valid JSON"),
    ("not an object", b"[1, 2]", "body: must be a JSON object"),
    ("groups not a list", b'{"groups": {}}', "groups: must be a JSON array"),
    ("wrong type", body_of(_bad(lambda o: _sample0(o)["token_ids"].__setitem__(0, 1.5))),
     "groups[0].rollouts[0].sample.token_ids[0]: must be an integer"),
    ("NaN logprob", body_of(_bad(lambda o: o["rollouts"][1]["sample"]["logprobs"].__setitem__(0, math.nan))),
     "groups[0].rollouts[1].sample.logprobs[0]: must be a finite number, got nan"),
    ("length mismatch", body_of(_bad(lambda o: _sample0(o)["token_ids"].append(7))),
     "groups[0].rollouts[0].sample.logprobs: length 4 != token_ids length 5"),
    ("second group bad", body_of(make_group("good"), _bad(lambda o: o["rollouts"][0].pop("reward"))),
     "groups[1].rollouts[0].reward: missing"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("body, message", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
async def test_malformed_request_is_400_naming_the_field_and_stores_nothing(body: bytes, message: str) -> None:
    async with serve() as (receiver, server):
        status, reply, _ = await raw_post(server.url, body)
        assert status == 400
        assert reply["error"].startswith(message) and message.startswith(reply["field"] + ":")
        assert_nothing_stored(receiver)
        assert "good" not in receiver


@pytest.mark.asyncio
async def test_client_refuses_a_bad_group_locally() -> None:
    bad = replace(make_group(), rollouts=(replace(make_group().rollouts[0], reward=math.nan),))
    async with serve() as (receiver, server), RemoteQueueClient(server.url, TOKEN) as client:
        with pytest.raises(WireError, match=r"^rollouts\[0\]\.reward"):
            await client.send(bad)
        assert server.counters.total() == 0 and receiver.depth == 0


@pytest.mark.asyncio
async def test_same_group_posted_twice_is_stored_once() -> None:
    group = make_group("dup")
    async with serve() as (receiver, server):
        first = await raw_post(server.url, body_of(group))
        retry = await raw_post(server.url, body_of(group))
        assert (first[0], first[1]["stored"], first[1]["duplicates"]) == (200, 1, 0)
        assert (retry[0], retry[1]["stored"], retry[1]["duplicates"]) == (200, 0, 1)
        async with RemoteQueueClient(server.url, TOKEN) as client:
            assert await client.send(group) is False
            assert await client.send_many([make_group("x"), make_group("x")]) == [True, False]
        assert receiver.depth == 2 and receiver.counters.entered == 2


@pytest.mark.asyncio
async def test_full_queue_answers_503_with_retry_after_and_lists_pending_groups() -> None:
    async with serve(capacity=2, put_timeout_s=0.1) as (receiver, server):
        with server.sender.clone() as local:
            await local.send(make_group("old"))
        status, body, headers = await raw_post(server.url, body_of(make_group("a"), make_group("b")))
        assert status == 503 and headers["Retry-After"] == "1"
        assert (body["reason"], body["results"], body["stored"]) == ("queue_full", ["stored", "pending"], 1)
        assert receiver.depth == 2 and "b" not in receiver


@pytest.mark.asyncio
async def test_backpressure_remote_send_waits_until_the_learner_takes_a_batch() -> None:
    trace, events = trace_events()
    async with serve(capacity=2, put_timeout_s=0.2, retry_after_s=0) as (receiver, server), \
            aiohttp.ClientSession(trace_configs=[trace]) as session, \
            RemoteQueueClient(server.url, TOKEN, session=session) as client:
        assert await client.send_many([make_group("q0"), make_group("q1")]) == [True, True]
        async with asyncio.TaskGroup() as tg:
            send = tg.create_task(client.send(make_group("q2")))
            for _ in range(2):  # refused, retried, refused again: the send is really waiting on the queue
                await asyncio.wait_for(events["503"].wait(), WAIT_S)
                events["503"].clear()
            assert not send.done() and receiver.depth == 2 and "q2" not in receiver
            batch = await receiver.receive_batch(1)  # the learner makes room
            assert await asyncio.wait_for(send, WAIT_S) is True
    assert [g.group_id for g in batch] == ["q0"] and "q2" in receiver and receiver.depth == 2


@pytest.mark.asyncio
async def test_client_retries_connection_errors_until_the_server_is_up() -> None:
    trace, events = trace_events()
    port = free_port()
    sender, receiver = create_rollout_queue(QueueConfig(capacity=4), VersionClock(4))
    server = RolloutIngestServer(sender, IngestServerConfig(token=TOKEN, port=port))
    async with aiohttp.ClientSession(trace_configs=[trace]) as session, \
            RemoteQueueClient(f"http://127.0.0.1:{port}", TOKEN, session=session, backoff_s=0.05,
                              max_retries=20) as client, asyncio.TaskGroup() as tg:
        send = tg.create_task(client.send(make_group()))
        await asyncio.wait_for(events["error"].wait(), WAIT_S)  # refused: nothing listens yet
        async with server:
            assert await asyncio.wait_for(send, WAIT_S) is True
            assert server.unnotified() == [client.producer_id]
            await client.close()  # a client that closes says it is leaving: the server need not wait for it
            assert server.unnotified() == []
    assert receiver.depth == 1 and sender.closed  # the server closed its sending end when it stopped


@pytest.mark.asyncio
async def test_client_gives_up_after_max_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with RemoteQueueClient(url, TOKEN, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RemoteQueueError, match="after 3 attempts") as info:
            await client.send(make_group())
    assert info.value.status is None and not isinstance(info.value, QueueClosed)


@pytest.mark.asyncio
async def test_closed_queue_is_503_and_client_raises_queue_closed() -> None:
    async with serve() as (receiver, server), RemoteQueueClient(server.url, TOKEN) as client:
        receiver.close()
        status, body, headers = await raw_post(server.url, body_of(make_group()))
        assert status == 503 and body["reason"] == "queue_closed" and "Retry-After" not in headers
        with pytest.raises(RemoteQueueClosed) as info:
            await client.send(make_group())
        assert isinstance(info.value, QueueClosed) and "closed" in info.value.message
        assert client.queue_closed and server.closed


CHILD = """
import asyncio, json, os, sys
from asyncrl.queues.ingest_client import RemoteQueueClient
from asyncrl.queues.wire import group_from_json

async def main():
    groups = [group_from_json(g) for g in json.load(sys.stdin)]
    async with RemoteQueueClient(os.environ["INGEST_URL"], os.environ["INGEST_TOKEN"]) as client:
        print(json.dumps({"pid": os.getpid(), "results": await client.send_many(groups)}))

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_a_separate_process_ships_groups_into_the_server() -> None:
    sent = [make_group(f"proc{i}") for i in range(3)]
    async with serve() as (receiver, server):
        env = {**os.environ, "INGEST_URL": server.url, "INGEST_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, cwd=REPO, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(child.communicate(json.dumps([group_to_json(g) for g in sent]).encode()), 12)
        assert child.returncode == 0, err.decode()
        reply = json.loads(out)
        got = await receiver.receive_batch(3)
    assert reply["results"] == [True, True, True] and reply["pid"] != os.getpid()
    assert got == sent
