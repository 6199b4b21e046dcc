"""Engine control over HTTP: ``EngineControl``'s routes on a real aiohttp server on 127.0.0.1 in front of a
``FakeEngine`` (auth, validation, weights, the pause lease), and ``RemoteControlEngine`` driving them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from asyncrl.engines.updates import InMemory
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.config import ConfigError, SyncConfig
from asyncrl.engines.embedded import ControlError, EngineControl, RemoteControlEngine, engine_control_routes
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.protocols import Lifecycle, Sampler, WeightTarget, WeightUpdate, WeightUpdateError
from asyncrl.engines.weights import ParamSpec, read_manifest
from asyncrl.versions import VersionClock
from tests.support.embedded import (
    TOKEN, WAIT_S, CheckedFakeEngine, call, control_server, model_with_weights, staged, weights,
)

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return model_with_weights(tmp_path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer"])
async def test_control_routes_refuse_requests_without_the_token(auth: str | None) -> None:
    engine = FakeEngine()
    async with control_server(engine) as (url, _):
        for method, path, body in [("POST", "pause", {"mode": "abort", "clear_cache": True}),
                                   ("POST", "resume", {}), ("POST", "weights", {"version": 1, "path": "/x"}),
                                   ("POST", "prepare", {"version": 1, "path": "/x"}), ("GET", "version", None)]:
            headers = {"Authorization": auth} if auth else {}
            async with aiohttp.ClientSession() as s:
                async with s.request(method, f"{url}/asyncrl/{path}", json=body, headers=headers) as resp:
                    assert resp.status == 401, path
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                    assert "token" in (await resp.json())["error"]
        assert await call(url, "GET", "health", token=None) == (200, {"ok": True})
    assert engine._running.is_set() and engine.version == 0 and not engine.weights  # nothing happened


BAD_BODIES: list[tuple[str, str, bytes, str]] = [
    ("not json", "pause", b'{"mode": ', "body: not valid JSON"),
    ("not an object", "pause", b"[1]", "body: must be a JSON object"),
    ("missing field", "pause", b'{"mode": "keep"}', "body: expected fields ['clear_cache', 'mode']"),
    ("unknown field", "weights", b'{"version": 1, "path": "/x", "x": 1}', "body: expected fields"),
    ("bad mode", "pause", b'{"mode": "sideways", "clear_cache": true}', "mode: must be one of"),
    ("bool clear_cache", "pause", b'{"mode": "keep", "clear_cache": "yes"}', "clear_cache: must be a boolean"),
    ("bool version", "weights", b'{"version": true, "path": "/x"}', "version: must be an integer"),
    ("negative version", "weights", b'{"version": -1, "path": "/x"}', "version: must be >= 0"),
    ("relative path", "weights", b'{"version": 1, "path": "x/y"}', "path: must be absolute"),
    ("missing dir", "weights", b'{"version": 1, "path": "/nonexistent/asyncrl"}',
     "path: '/nonexistent/asyncrl' is not"),
    ("oversize", "pause", b'{"mode": "' + b"k" * (64 << 10) + b'", "clear_cache": true}', "request body exceeds"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, raw, message", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
async def test_malformed_control_requests_are_400_and_change_nothing(path: str, raw: bytes, message: str) -> None:
    engine = FakeEngine()
    async with control_server(engine) as (url, control):
        status, reply = await call(url, "POST", path, raw=raw)
        assert status == (413 if message.startswith("request body") else 400) and reply["error"].startswith(message)
        assert status == 413 or message.startswith(reply["field"] + ":")  # a 400 names the field
        assert not control.paused
    assert engine._running.is_set() and engine.version == 0


@pytest.mark.timeout(30)
async def test_weights_post_loads_the_staged_tensors_and_a_refused_update_is_409(model_dir: Path,
                                                                                 staging: Path) -> None:
    engine = CheckedFakeEngine(read_manifest(model_dir))
    async with control_server(engine) as (url, control):
        assert (await call(url, "POST", "pause", {"mode": "keep", "clear_cache": True}))[0] == 200
        new = weights(seed=1)
        status, reply = await call(url, "POST", "weights", {"version": 1, "path": staged(new, staging)})
        assert (status, reply) == (200, {"version": 1})
        assert engine.weights.keys() == new.keys() and all(torch.equal(engine.weights[k], new[k]) for k in new)
        bad = staged({"layer.weight": torch.zeros(4, 3)}, staging)  # layer.bias missing
        status, reply = await call(url, "POST", "weights", {"version": 2, "path": bad})
        assert status == 409 and "missing ['layer.bias']" in reply["error"]
        assert (await call(url, "POST", "resume", {}))[0] == 200
        status, reply = await call(url, "GET", "version")
        assert (status, reply["version"], reply["paused"], reply["max_model_len"]) == (200, 1, False, 256)
        assert control.counters["weights_200"] == 1 and control.counters["weights_409"] == 1
    # One call prepares, loads and releases; the refused update was never prepared, so nothing to release.
    assert engine.version == 1 and engine._running.is_set() and (engine.prepared, engine.released) == ([1], [1])


@pytest.mark.timeout(30)
async def test_prepare_then_load_only_the_prepared_version(model_dir: Path, staging: Path) -> None:
    engine = CheckedFakeEngine(read_manifest(model_dir))
    async with control_server(engine) as (url, control):
        status, reply = await call(url, "POST", "weights", {"version": 2})
        assert status == 409 and "no prepared update for version 2" in reply["error"]
        for version in (1, 2):  # the second prepare replaces (releases) the first
            path = staged(weights(seed=version), staging)
            reply = await call(url, "POST", "prepare", {"version": version, "path": path})
            assert reply == (200, {"prepared": version})
        assert (engine.prepared, engine.released) == ([1, 2], [1])
        assert (await call(url, "POST", "weights", {"version": 1}))[0] == 409  # not the prepared one; kept
        assert await call(url, "POST", "weights", {"version": 2}) == (200, {"version": 2})
        assert torch.equal(engine.weights["layer.bias"], weights(seed=2)["layer.bias"])
        assert engine.released == [1, 2]  # released once loaded (the engine keeps its own reference)
        assert (await call(url, "POST", "weights", {"version": 2}))[0] == 409  # loaded once, then gone
        path = staged(weights(seed=3), staging)
        assert (await call(url, "POST", "prepare", {"version": 3, "path": path}))[0] == 200
        assert (await call(url, "POST", "resume", {}))[0] == 200  # a publication ends with its resume
        assert engine.released == [1, 2, 3] and (await call(url, "POST", "weights", {"version": 3}))[0] == 409
        path = staged(weights(seed=4), staging)
        assert (await call(url, "POST", "prepare", {"version": 4, "path": path}))[0] == 200
        assert await control.detach() is engine  # the service's engine goes away: its prepared update is dropped
        assert engine.released == [1, 2, 3, 4]


@pytest.mark.timeout(30)
async def test_weights_root_confines_paths_and_unstarted_or_dead_engines_are_503(model_dir: Path,
                                                                                 staging: Path) -> None:
    async with control_server(FakeEngine(), weights_root=staging) as (url, _):
        status, reply = await call(url, "POST", "weights", {"version": 1, "path": str(model_dir)})
        assert status == 403 and "outside the service's weights_root" in reply["error"]
    async with control_server(None) as (url, control):
        assert await call(url, "GET", "version") == (503, {"error": "engine not started yet"})
        assert (await call(url, "GET", "health", token=None))[0] == 503
        engine = FakeEngine()
        control.attach(engine)
        assert (await call(url, "GET", "health", token=None))[0] == 200
        engine.alive = False
        status, reply = await call(url, "GET", "health", token=None)
        assert status == 503 and "marked dead" in reply["error"]
        assert (await call(url, "POST", "pause", {"mode": "keep", "clear_cache": False}))[0] == 503
    assert len(engine_control_routes(FakeEngine(), TOKEN, prefix="/rl/")) == 6
    with pytest.raises(ConfigError, match="EngineControl.token"):
        EngineControl(None, "has space")


@pytest.mark.timeout(30)
async def test_a_pause_without_resume_expires_and_the_engine_resumes() -> None:
    engine = FakeEngine()
    async with control_server(engine, max_pause_s=0.2) as (url, control):
        assert (await call(url, "POST", "pause", {"mode": "keep", "clear_cache": False}))[0] == 200
        assert not engine._running.is_set() and control.paused
        await asyncio.wait_for(engine._running.wait(), WAIT_S)  # the learner never came back
        assert not control.paused


@pytest.mark.timeout(30)
async def test_remote_control_engine_drives_the_standard_weight_sync(model_dir: Path, staging: Path) -> None:
    engine = CheckedFakeEngine(read_manifest(model_dir))
    async with control_server(engine) as (url, control):
        remote = await RemoteControlEngine.connect(url, TOKEN, model_dir, staging_dir=staging)
        try:
            assert isinstance(remote, WeightTarget) and isinstance(remote, Lifecycle)
            assert not isinstance(remote, Sampler) and not hasattr(remote, "generate")  # it never samples
            assert TOKEN not in repr(remote) and remote.version == 0
            clock = VersionClock(remote.version)
            new = weights(seed=2)
            timing = await WeightSync(remote, clock, SyncConfig(mode="keep")).publish(new, version=1)
            assert timing.version == 1 and remote.version == engine.version == clock.served == 1
            assert (engine.prepared, engine.prepared_while_paused, engine.released) == ([1], [], [1])
            assert all(torch.equal(engine.weights[k], new[k]) for k in new)
            assert engine._running.is_set() and not control.paused  # resumed
            assert list(staging.iterdir()) == []  # the staged copy was deleted once the service read it
            await remote.check_alive()
            with pytest.raises(WeightUpdateError, match="NaN"):  # refused here, nothing sent
                await remote.prepare(WeightUpdate(2, InMemory({**new, "layer.bias": torch.full((3,), torch.nan)})))
            # version, prepare + pause + weights + resume, health
            assert control.counters["weights_200"] == 1 and control.counters.total() == 6
            engine.manifest = {**engine.manifest, "extra.weight": ParamSpec((1,), "F32")}
            with pytest.raises(WeightUpdateError, match="HTTP 409.*missing \\['extra.weight'\\]"):
                await WeightSync(remote, clock, SyncConfig()).publish(new, version=2)  # refused by the service
            assert control.counters["prepare_409"] == 1 and control.counters["pause_200"] == 1  # before pausing
            with pytest.raises(WeightUpdateError, match="was not prepared"):
                await remote.load(WeightUpdate(2, InMemory(new)))  # only a prepared update loads: refused, nothing sent
            assert remote.version == engine.version == clock.served == 1 and list(staging.iterdir()) == []
        finally:
            await remote.close()
        wrong = RemoteControlEngine(url, "wrong", model_dir)
        with pytest.raises(ControlError, match="HTTP 401") as info:
            await wrong.refresh()
        assert info.value.status == 401
        await wrong.close()


@pytest.mark.timeout(30)
async def test_connect_waits_for_the_service_engine_to_start(model_dir: Path) -> None:
    refused = asyncio.Semaphore(0)  # released once per 503 the service answers
    async with control_server(None, on_response=lambda r: r.status == 503 and refused.release()) as (url, control):
        with pytest.raises(ControlError, match="HTTP 503.*not started") as info:
            await RemoteControlEngine.connect(url, TOKEN, model_dir, ready_timeout_s=0.0)
        assert info.value.status == 503
        await refused.acquire()
        connecting = asyncio.ensure_future(RemoteControlEngine.connect(url, TOKEN, model_dir, ready_timeout_s=WAIT_S))
        for _ in range(2):  # refused twice: it is really waiting, not failing
            await asyncio.wait_for(refused.acquire(), WAIT_S)
        assert not connecting.done()
        control.attach(FakeEngine())
        remote = await asyncio.wait_for(connecting, WAIT_S)
        assert remote.version == 0
        await remote.close()
