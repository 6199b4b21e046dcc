"""The rollout queue over HTTP: wire format, ingestion server, client, and a producer in another process.

Every server test runs a real aiohttp server on 127.0.0.1 in front of a real ``RolloutQueue``. Waiting is
done on events (aiohttp trace hooks tell us when a response or a connection error happened), not sleeps.
"""

from __future__ import annotations

import asyncio
import json
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

from asyncrl.config import ConfigError, QueueConfig
from asyncrl.queues.remote import (
    GroupSink, IngestServerConfig, RemoteQueueClient, RemoteQueueClosed, RemoteQueueError, RolloutIngestServer,
)
from asyncrl.queues.rollout_queue import QueueClosed, RolloutQueue
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, VersionSpan

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"
WAIT_S = 5.0  # upper bound on any awaited event; tests finish far sooner


def make_group(gid: str = "g0", *, n: int = 2, tokens: int = 4) -> RolloutGroup:
    """A group whose rollouts span two weight versions (3 then 4), so staleness and spans are exercised."""
    prompt = Prompt(f"p-{gid}", (1, 2, 3), text="2+2=", answer={"value": 4, "alts": ["four", None], "ok": True})
    half = tokens // 2
    rollouts = tuple(
        Rollout(
            group_id=gid, prompt_ids=(1, 2, 3), completion_ids=tuple(range(10 + i, 10 + i + tokens)),
            behaviour_logprobs=tuple(-0.1 * (k + 1) - i for k in range(tokens)), reward=float(i) - 0.5,
            finish_reason=FinishReason.STOP if i % 2 == 0 else FinishReason.LENGTH,
            version_spans=(VersionSpan(3, 0, half), VersionSpan(4, half, tokens)),
            version_start=3, version_end=4, text=f"completion {i}",
        )
        for i in range(n)
    )
    return RolloutGroup(gid, prompt, rollouts, created_at=12.5, meta={"producer": "p0", "staleness_tag": 1})


def as_queued(sent: RolloutGroup, got: RolloutGroup) -> RolloutGroup:
    """The queue restamps ``created_at`` on arrival; every other field must arrive unchanged."""
    return replace(got, created_at=sent.created_at)


@asynccontextmanager
async def serve(capacity: int = 8, **cfg: Any) -> AsyncIterator[tuple[RolloutQueue, RolloutIngestServer]]:
    queue = RolloutQueue(QueueConfig(capacity=capacity, max_staleness=1))
    async with RolloutIngestServer(queue, IngestServerConfig(token=TOKEN, **cfg)) as server:
        yield queue, server


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


def assert_nothing_stored(queue: RolloutQueue) -> None:
    assert queue.depth == 0 and queue.ledger.queued == 0


def trace_events() -> tuple[aiohttp.TraceConfig, dict[str, asyncio.Event]]:
    """Events set by the client session when a 503 arrives or a request fails in transport."""
    events = {"503": asyncio.Event(), "error": asyncio.Event()}
    trace = aiohttp.TraceConfig()

    async def on_end(session: Any, ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        if params.response.status == 503:
            events["503"].set()

    async def on_exception(session: Any, ctx: Any, params: Any) -> None:
        events["error"].set()

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
    assert group_to_json(group)["v"] == 1
    r = back.rollouts[1]
    assert type(back.rollouts) is tuple and type(r.completion_ids) is tuple and type(r.version_spans) is tuple
    assert type(back.prompt.token_ids) is tuple and r.finish_reason is FinishReason.LENGTH
    assert r.version_spans == (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5))
    assert back.staleness(5) == group.staleness(5) == 2 and back.newest_version == 4


def test_wire_carries_an_empty_completion_with_its_submit_version() -> None:
    r = replace(make_group().rollouts[0], completion_ids=(), behaviour_logprobs=(), finish_reason=FinishReason.ABORT,
                version_spans=(VersionSpan(5, 0, 0),), version_start=5, version_end=5)
    group = replace(make_group(), rollouts=(r,))
    assert group_from_json(json.loads(json.dumps(group_to_json(group)))) == group


def _rollout0(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["rollouts"][0]


WIRE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("str token id", lambda o: _rollout0(o)["completion_ids"].__setitem__(1, "11"),
     "rollouts[0].completion_ids[1]: must be an integer >= 0"),
    ("bool token id", lambda o: o["prompt"]["token_ids"].__setitem__(0, True),
     "prompt.token_ids[0]: must be an integer"),
    ("NaN logprob", lambda o: _rollout0(o)["behaviour_logprobs"].__setitem__(2, math.nan),
     "rollouts[0].behaviour_logprobs[2]: must be a finite number, got nan"),
    ("inf reward", lambda o: _rollout0(o).__setitem__("reward", math.inf), "rollouts[0].reward: must be a finite"),
    ("length mismatch", lambda o: o["rollouts"][1]["behaviour_logprobs"].pop(),
     "rollouts[1].behaviour_logprobs: length 3 != completion_ids length 4"),
    ("unknown finish", lambda o: _rollout0(o).__setitem__("finish_reason", "eos"),
     "rollouts[0].finish_reason: must be"),
    ("spans short", lambda o: _rollout0(o)["version_spans"].pop(),
     "rollouts[0].version_spans: cover 2 tokens but completion_ids has 4"),
    ("span gap", lambda o: _rollout0(o)["version_spans"][1].__setitem__("start", 3),
     "rollouts[0].version_spans[1].start: 3 != 2"),
    ("empty span among tokens", lambda o: _rollout0(o)["version_spans"].insert(1, {"version": 3, "start": 2, "end": 2}),
     "rollouts[0].version_spans[1].end: 2 <= start 2"),
    ("negative version", lambda o: _rollout0(o)["version_spans"][0].__setitem__("version", -1),
     "rollouts[0].version_spans[0].version: must be an integer >= 0"),
    ("version_start off", lambda o: _rollout0(o).__setitem__("version_start", 2),
     "rollouts[0].version_start: 2 != first span's version 3"),
    ("wrong group id", lambda o: _rollout0(o).__setitem__("group_id", "other"), "rollouts[0].group_id: 'other'"),
    ("unknown field", lambda o: o.__setitem__("extra", 1), "extra: unknown field"),
    ("missing field", lambda o: o["prompt"].pop("text"), "prompt.text: missing"),
    ("no rollouts", lambda o: o.__setitem__("rollouts", []), "rollouts: a group needs at least one rollout"),
    ("future version", lambda o: o.__setitem__("v", 2), "v: unsupported wire version 2"),
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
    assert TOKEN not in repr(cfg)
    for kwargs, name in [({"token": ""}, "token"), ({"token": "a b"}, "token"), ({"port": 70000}, "port"),
                         ({"put_timeout_s": 0}, "put_timeout_s"), ({"max_body_bytes": 0}, "max_body_bytes")]:
        with pytest.raises(ConfigError) as info:
            IngestServerConfig(**{"token": TOKEN, **kwargs})
        assert info.value.field == f"IngestServerConfig.{name}"


# ---------------------------------------------------------------- server + client


@pytest.mark.asyncio
async def test_round_trip_preserves_every_field_and_binds_loopback() -> None:
    sent = [make_group("a"), make_group("b", n=3, tokens=6)]
    async with serve() as (queue, server), RemoteQueueClient(server.url, TOKEN) as client:
        assert server.url.startswith("http://127.0.0.1:")
        assert isinstance(client, GroupSink) and isinstance(queue, GroupSink)
        assert await client.put(sent[0]) is True
        assert await client.put_many(sent[1:]) == [True]
        got = await queue.get_batch(2, current_version=4)
    assert [as_queued(s, g) for s, g in zip(sent, got)] == sent
    assert [g.staleness(4) for g in got] == [1, 1]


@pytest.mark.asyncio
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"])
async def test_missing_or_wrong_token_is_401_and_stores_nothing(auth: str | None) -> None:
    async with serve() as (queue, server):
        status, body, headers = await raw_post(server.url, body_of(make_group()), token=None,
                                               headers={"Authorization": auth} if auth else None)
        assert status == 401 and "token" in body["error"] and headers["WWW-Authenticate"].startswith("Bearer")
        assert_nothing_stored(queue)


@pytest.mark.asyncio
async def test_client_with_wrong_token_raises_and_stats_need_auth_but_health_does_not() -> None:
    async with serve() as (queue, server):
        async with RemoteQueueClient(server.url, "nope") as client:
            with pytest.raises(RemoteQueueError) as info:
                await client.put(make_group())
        assert info.value.status == 401
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/v1/health") as resp:
                assert resp.status == 200 and (await resp.json())["ok"] is True
            async with s.get(server.url + "/v1/stats") as resp:
                assert resp.status == 401
            async with s.get(server.url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                stats = await resp.json()
        assert (stats["depth"], stats["capacity"], stats["closed"]) == (0, 8, False)
        assert (stats["counts"]["http_401"], stats["counts"]["auth_failures"]) == (1, 2)  # 1 POST, 1 GET
        assert stats["queue"]["queue/depth"] == 0
        assert_nothing_stored(queue)


@pytest.mark.asyncio
async def test_oversize_body_is_413_by_content_length_and_by_streamed_size() -> None:
    big = make_group(tokens=2000)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: client_max_size must catch it
        data = body_of(big)
        for i in range(0, len(data), 1024):
            yield data[i:i + 1024]

    async with serve(max_body_bytes=4096) as (queue, server):
        status, body, _ = await raw_post(server.url, body_of(big))
        assert status == 413 and "max_body_bytes=4096" in body["error"]
        status, body, _ = await raw_post(server.url, chunked())
        assert status == 413 and "max_body_bytes=4096" in body["error"]
        async with RemoteQueueClient(server.url, TOKEN) as client:
            with pytest.raises(RemoteQueueError) as info:
                await client.put(big)
        assert info.value.status == 413
        assert_nothing_stored(queue)


@pytest.mark.asyncio
async def test_too_many_groups_is_413_and_client_splits_requests() -> None:
    groups = [make_group(f"g{i}") for i in range(5)]
    async with serve(max_groups_per_request=2) as (queue, server):
        status, body, _ = await raw_post(server.url, body_of(*groups[:3]))
        assert status == 413 and "max_groups_per_request=2" in body["error"]
        assert_nothing_stored(queue)
        async with RemoteQueueClient(server.url, TOKEN, max_groups_per_request=2) as client:
            assert await client.put_many(groups) == [True] * 5
        assert queue.depth == 5


def _bad(mutate: Callable[[dict[str, Any]], None], gid: str = "bad") -> dict[str, Any]:
    obj = group_to_json(make_group(gid))
    mutate(obj)
    return obj


BAD_REQUESTS: list[tuple[str, bytes, str]] = [
    ("malformed json", b'{"groups": [', "body: not valid JSON"),
    ("not an object", b"[1, 2]", "body: must be a JSON object"),
    ("groups not a list", b'{"groups": {}}', "groups: must be a JSON array"),
    ("wrong type", body_of(_bad(lambda o: o["rollouts"][0]["completion_ids"].__setitem__(0, 1.5))),
     "groups[0].rollouts[0].completion_ids[0]: must be an integer"),
    ("NaN logprob", body_of(_bad(lambda o: o["rollouts"][1]["behaviour_logprobs"].__setitem__(0, math.nan))),
     "groups[0].rollouts[1].behaviour_logprobs[0]: must be a finite number, got nan"),
    ("length mismatch", body_of(_bad(lambda o: o["rollouts"][0]["completion_ids"].append(7))),
     "groups[0].rollouts[0].behaviour_logprobs: length 4 != completion_ids length 5"),
    ("second group bad", body_of(make_group("good"), _bad(lambda o: o["rollouts"][0].pop("reward"))),
     "groups[1].rollouts[0].reward: missing"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("body, message", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
async def test_malformed_request_is_400_naming_the_field_and_stores_nothing(body: bytes, message: str) -> None:
    async with serve() as (queue, server):
        status, reply, _ = await raw_post(server.url, body)
        assert status == 400
        assert reply["error"].startswith(message)
        assert_nothing_stored(queue)
        assert "good" not in queue


@pytest.mark.asyncio
async def test_client_refuses_a_bad_group_locally() -> None:
    bad = replace(make_group(), rollouts=(replace(make_group().rollouts[0], reward=math.nan),))
    async with serve() as (queue, server), RemoteQueueClient(server.url, TOKEN) as client:
        with pytest.raises(WireError, match=r"^rollouts\[0\]\.reward"):
            await client.put(bad)
        assert server.counts.total() == 0 and queue.depth == 0


@pytest.mark.asyncio
async def test_same_group_posted_twice_is_stored_once() -> None:
    group = make_group("dup")
    async with serve() as (queue, server):
        first = await raw_post(server.url, body_of(group))
        retry = await raw_post(server.url, body_of(group))
        assert (first[0], first[1]["stored"], first[1]["duplicates"]) == (200, 1, 0)
        assert (retry[0], retry[1]["stored"], retry[1]["duplicates"]) == (200, 0, 1)
        async with RemoteQueueClient(server.url, TOKEN) as client:
            assert await client.put(group) is False
            assert await client.put_many([make_group("x"), make_group("x")]) == [True, False]
        assert queue.depth == 2 and queue.ledger.queued == 2


@pytest.mark.asyncio
async def test_full_queue_answers_503_with_retry_after_and_lists_pending_groups() -> None:
    async with serve(capacity=2, put_timeout_s=0.1) as (queue, server):
        await queue.put(make_group("old"))
        status, body, headers = await raw_post(server.url, body_of(make_group("a"), make_group("b")))
        assert status == 503 and headers["Retry-After"] == "1"
        assert (body["reason"], body["results"], body["stored"]) == ("queue_full", ["stored", "pending"], 1)
        assert queue.depth == 2 and "b" not in queue


@pytest.mark.asyncio
async def test_backpressure_remote_put_waits_until_the_learner_takes_a_batch() -> None:
    trace, events = trace_events()
    async with serve(capacity=2, put_timeout_s=0.2, retry_after_s=0) as (queue, server), \
            aiohttp.ClientSession(trace_configs=[trace]) as session, \
            RemoteQueueClient(server.url, TOKEN, session=session) as client:
        assert await client.put_many([make_group("q0"), make_group("q1")]) == [True, True]
        async with asyncio.TaskGroup() as tg:
            put = tg.create_task(client.put(make_group("q2")))
            for _ in range(2):  # refused, retried, refused again: the put is really waiting on the queue
                await asyncio.wait_for(events["503"].wait(), WAIT_S)
                events["503"].clear()
            assert not put.done() and queue.depth == 2 and "q2" not in queue
            batch = await queue.get_batch(1, current_version=4)  # the learner makes room
            assert await asyncio.wait_for(put, WAIT_S) is True
    assert [g.group_id for g in batch] == ["q0"] and "q2" in queue and queue.depth == 2


@pytest.mark.asyncio
async def test_client_retries_connection_errors_until_the_server_is_up() -> None:
    trace, events = trace_events()
    port = free_port()
    queue = RolloutQueue(QueueConfig(capacity=4))
    server = RolloutIngestServer(queue, IngestServerConfig(token=TOKEN, port=port))
    async with aiohttp.ClientSession(trace_configs=[trace]) as session, \
            RemoteQueueClient(f"http://127.0.0.1:{port}", TOKEN, session=session, backoff_s=0.05,
                              max_retries=20) as client, asyncio.TaskGroup() as tg:
        put = tg.create_task(client.put(make_group()))
        await asyncio.wait_for(events["error"].wait(), WAIT_S)  # refused: nothing listens yet
        async with server:
            assert await asyncio.wait_for(put, WAIT_S) is True
    assert queue.depth == 1


@pytest.mark.asyncio
async def test_client_gives_up_after_max_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with RemoteQueueClient(url, TOKEN, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RemoteQueueError, match="after 3 attempts") as info:
            await client.put(make_group())
    assert info.value.status is None


@pytest.mark.asyncio
async def test_closed_queue_is_503_and_client_raises_queue_closed() -> None:
    async with serve() as (queue, server), RemoteQueueClient(server.url, TOKEN) as client:
        await queue.close()
        status, body, headers = await raw_post(server.url, body_of(make_group()))
        assert status == 503 and body["reason"] == "queue_closed" and "Retry-After" not in headers
        with pytest.raises(RemoteQueueClosed) as info:
            await client.put(make_group())
        assert isinstance(info.value, QueueClosed) and "closed" in info.value.message


CHILD = """
import asyncio, json, os, sys
from asyncrl.queues.remote import RemoteQueueClient
from asyncrl.queues.wire import group_from_json

async def main():
    groups = [group_from_json(g) for g in json.load(sys.stdin)]
    async with RemoteQueueClient(os.environ["INGEST_URL"], os.environ["INGEST_TOKEN"]) as client:
        print(json.dumps({"pid": os.getpid(), "results": await client.put_many(groups)}))

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_a_separate_process_ships_groups_into_the_server() -> None:
    sent = [make_group(f"proc{i}") for i in range(3)]
    async with serve() as (queue, server):
        env = {**os.environ, "INGEST_URL": server.url, "INGEST_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, cwd=REPO, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(child.communicate(json.dumps([group_to_json(g) for g in sent]).encode()), 12)
        assert child.returncode == 0, err.decode()
        reply = json.loads(out)
        got = await queue.get_batch(3, current_version=4)
    assert reply["results"] == [True, True, True] and reply["pid"] != os.getpid()
    assert [as_queued(s, g) for s, g in zip(sent, got)] == sent
