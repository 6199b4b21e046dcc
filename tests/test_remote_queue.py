"""The rollout queue over HTTP: wire format, ingestion server, client, the shutdown handshake, and a producer
in another process.

Every server test runs a real aiohttp server on 127.0.0.1 in front of a real rollout queue (the server holds
its sending end, the test its receiving end). Waiting is done on events (aiohttp trace hooks tell us when a
response or a connection error happened), not sleeps; where no event exists (a post parked on a full queue in
the server) a bounded poll of the queue's statistics stands in.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from asyncrl.actors.producer import Producer
from asyncrl.config import ConfigError, ProducerConfig, QueueConfig, SamplingConfig
from asyncrl.data import PromptSource
from asyncrl.engines.fake import FakeEngine
from asyncrl.errors import QueueClosed
from asyncrl.queues.ingest_client import RemoteQueueClient, RemoteQueueClosed, RemoteQueueError
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer
from asyncrl.queues.rollout_queue import RolloutReceiver, create_rollout_queue
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan
from asyncrl.versions import VersionClock

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]

REPO = Path(__file__).resolve().parents[1]
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
    assert receiver.depth == 0 and receiver.counters.queued == 0


def is_group_sink(obj: Any) -> bool:
    """What a ``Producer`` needs of its sink: ``async send(group) -> bool``."""
    return inspect.iscoroutinefunction(getattr(obj, "send", None))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` for what has no event (a post parked on a full queue inside the server)."""
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"no {what} within {WAIT_S}s") from None


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- wire format


def test_wire_round_trip_is_exact_through_json_text() -> None:
    group = make_group(tokens=5)
    back = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert back == group
    assert group_to_json(group)["v"] == 3
    s = back.rollouts[1].sample
    assert type(back.rollouts) is tuple and type(s.token_ids) is tuple and type(s.version_spans) is tuple
    assert type(back.prompt.token_ids) is tuple and s.finish_reason is FinishReason.LENGTH
    assert s.version_spans == (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5))
    assert back.staleness(5) == group.staleness(5) == 2 and back.newest_version == 4


def test_wire_carries_the_prompt_ids_once_per_group_and_no_arrival_time() -> None:
    obj = group_to_json(make_group(n=3))
    assert set(obj) == {"v", "group_id", "meta", "prompt", "rollouts"}
    assert obj["prompt"]["token_ids"] == [1, 2, 3]
    assert all(set(r) == {"sample", "reward"} and "prompt_ids" not in r["sample"] for r in obj["rollouts"])


def test_wire_carries_an_empty_completion_with_its_submit_version() -> None:
    empty = Sample((), (), FinishReason.ABORT, (VersionSpan(5, 0, 0),))
    group = replace(make_group(), rollouts=(Rollout(empty, 0.0),))
    assert group_from_json(json.loads(json.dumps(group_to_json(group)))) == group


def _sample0(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["rollouts"][0]["sample"]


def _empty(obj: dict[str, Any], spans: list[dict[str, int]]) -> None:
    _sample0(obj).update(token_ids=[], logprobs=[], version_spans=spans)


WIRE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("str token id", lambda o: _sample0(o)["token_ids"].__setitem__(1, "11"),
     "rollouts[0].sample.token_ids[1]: must be an integer >= 0"),
    ("bool token id", lambda o: o["prompt"]["token_ids"].__setitem__(0, True),
     "prompt.token_ids[0]: must be an integer"),
    ("NaN logprob", lambda o: _sample0(o)["logprobs"].__setitem__(2, math.nan),
     "rollouts[0].sample.logprobs[2]: must be a finite number, got nan"),
    ("inf reward", lambda o: o["rollouts"][0].__setitem__("reward", math.inf), "rollouts[0].reward: must be a finite"),
    ("length mismatch", lambda o: o["rollouts"][1]["sample"]["logprobs"].pop(),
     "rollouts[1].sample.logprobs: length 3 != token_ids length 4"),
    ("unknown finish", lambda o: _sample0(o).__setitem__("finish_reason", "eos"),
     "rollouts[0].sample.finish_reason: must be"),
    ("spans short", lambda o: _sample0(o)["version_spans"].pop(),
     "rollouts[0].sample.version_spans: cover 2 tokens but token_ids has 4"),
    ("span gap", lambda o: _sample0(o)["version_spans"][1].__setitem__("start", 3),
     "rollouts[0].sample.version_spans[1].start: 3 != 2"),
    ("empty span among tokens",
     lambda o: _sample0(o)["version_spans"].insert(1, {"version": 3, "start": 2, "end": 2}),
     "rollouts[0].sample.version_spans[1].end: 2 <= start 2"),
    ("negative version", lambda o: _sample0(o)["version_spans"][0].__setitem__("version", -1),
     "rollouts[0].sample.version_spans[0].version: must be an integer >= 0"),
    ("version goes back", lambda o: _sample0(o)["version_spans"][1].__setitem__("version", 2),
     "rollouts[0].sample.version_spans[1].version: 2 < previous span's 3"),
    ("empty completion, no span", lambda o: _empty(o, []),
     "rollouts[0].sample.version_spans: an empty completion carries exactly one empty span, got 0"),
    ("empty completion, two spans",
     lambda o: _empty(o, [{"version": 3, "start": 0, "end": 0}, {"version": 4, "start": 0, "end": 0}]),
     "rollouts[0].sample.version_spans: an empty completion carries exactly one empty span, got 2"),
    ("empty completion, span not empty", lambda o: _empty(o, [{"version": 3, "start": 0, "end": 1}]),
     "rollouts[0].sample.version_spans[0].end: must be 0"),
    ("v1 rollout field", lambda o: o["rollouts"][0].__setitem__("group_id", "g0"),
     "rollouts[0].group_id: unknown field"),
    ("v1 group field", lambda o: o.__setitem__("created_at", 12.5), "created_at: unknown field"),
    ("unknown field", lambda o: o.__setitem__("extra", 1), "extra: unknown field"),
    ("missing field", lambda o: o["prompt"].pop("text"), "prompt.text: missing"),
    ("missing sample field", lambda o: _sample0(o).pop("text"), "rollouts[0].sample.text: missing"),
    ("no rollouts", lambda o: o.__setitem__("rollouts", []), "rollouts: a group needs at least one rollout"),
    ("old version", lambda o: o.__setitem__("v", 2), "v: unsupported wire version 2; this build reads 3"),
    ("future version", lambda o: o.__setitem__("v", 4), "v: unsupported wire version 4"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in WIRE_CASES], ids=[c[0] for c in WIRE_CASES])
def test_wire_rejects_bad_fields_naming_the_path(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    obj = group_to_json(make_group())
    mutate(obj)
    with pytest.raises(WireError, match="^" + re.escape(message)):
        group_from_json(obj)


@pytest.mark.parametrize("answer, path", [((1, 2), "prompt.answer"), ({1, 2}, "prompt.answer"),
                                          ({"k": [math.nan]}, "prompt.answer.k[0]"), ({1: "x"}, "prompt.answer")])
def test_wire_encode_refuses_answers_json_cannot_carry_exactly(answer: Any, path: str) -> None:
    group = replace(make_group(), prompt=replace(make_group().prompt, answer=answer))
    with pytest.raises(WireError) as info:
        group_to_json(group)
    assert info.value.path == path


def test_config_is_validated_and_hides_the_token() -> None:
    cfg = IngestServerConfig(token=TOKEN)
    assert (cfg.host, cfg.port, cfg.max_body_bytes, cfg.put_timeout_s) == ("127.0.0.1", 0, 4 << 20, 5.0)
    assert (cfg.close_grace_s, cfg.active_window_s) == (10.0, 60.0)
    assert TOKEN not in repr(cfg)
    for kwargs, name in [({"token": ""}, "token"), ({"token": "a b"}, "token"), ({"port": 70000}, "port"),
                         ({"put_timeout_s": 0}, "put_timeout_s"), ({"max_body_bytes": 0}, "max_body_bytes"),
                         ({"close_grace_s": -1}, "close_grace_s"), ({"active_window_s": 0}, "active_window_s")]:
        with pytest.raises(ConfigError) as info:
            IngestServerConfig(**{"token": TOKEN, **kwargs})
        assert info.value.field == f"IngestServerConfig.{name}"
    for kwargs, name in [({"token": ""}, "token"), ({"url": "ftp://x"}, "url"), ({"max_retries": -1}, "max_retries"),
                         ({"producer_id": "a\nb"}, "producer_id")]:
        with pytest.raises(ConfigError) as info:
            RemoteQueueClient(**{"url": "http://127.0.0.1:1", "token": TOKEN, **kwargs})
        assert info.value.field == f"RemoteQueueClient.{name}"
    assert TOKEN not in repr(RemoteQueueClient("http://127.0.0.1:1", TOKEN))


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
        assert receiver.depth == 2 and receiver.counters.queued == 2


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
    assert server.counters["groups_pending"] == 1 and receiver.counters.queued == 1


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
        producer = Producer(engine, PromptSource(items), lambda prompt, sample: 1.0, client, config)
        running = asyncio.create_task(producer.run())
        batch = await receiver.receive_batch(3)
        receiver.close()  # the learner is done
        await asyncio.wait_for(server.stop(), WAIT_S)
        await asyncio.wait_for(running, WAIT_S)  # returned: "queue closed" ends a producer, it is no failure
    assert len(batch) == 3 and client.queue_closed and server.unnotified() == []
    assert producer.counters.groups >= 3 and server.counters["groups_stored"] == producer.counters.groups


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
