"""A remote vLLM server is dead only after several failed health probes across a window, never after one slow
answer: against a loopback server whose /health is slow on purpose, and against a real vLLM server beside
CPU-burning neighbours."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from asyncrl.engines.vllm_remote.api import ServerApi
from asyncrl.engines.vllm_remote.config import RemoteEngineConfig
from asyncrl.errors import EngineError


class SlowHealth:
    """/health that answers after ``delays[i]`` seconds on its i-th call (the last delay repeats)."""

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.calls = delays, 0

    async def health(self, request: web.Request) -> web.Response:
        delay = self.delays[min(self.calls, len(self.delays) - 1)]
        self.calls += 1
        await asyncio.sleep(delay)
        return web.Response(text="")


async def _api(delays: list[float], model_dir: Path, **cfg: object):
    slow = SlowHealth(delays)
    app = web.Application()
    app.router.add_get("/health", slow.health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = RemoteEngineConfig(base_url=f"http://127.0.0.1:{port}", model="m", model_dir=str(model_dir),
                                health_timeout_s=0.3, health_retry_s=0.05, **cfg)  # type: ignore[arg-type]
    session = aiohttp.ClientSession()
    return slow, runner, session, ServerApi(session, config, "slow")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"")  # the config only checks that weights exist
    return tmp_path


@pytest.mark.parametrize("delays, dead", [
    ([1.0, 0.0], False),  # one answer slower than the timeout: not dead
    ([1.0, 1.0, 0.0], False),  # two in a row: still not dead with 3 allowed
    ([1.0], True),  # every probe too slow: dead
])
async def test_one_slow_health_answer_is_not_a_death(model_dir, delays, dead):
    slow, runner, session, api = await _api(delays, model_dir, health_failures=3)
    try:
        t0 = time.monotonic()
        if dead:
            with pytest.raises(EngineError, match="failed 3 health probes in a row"):
                await api.check_health()
        else:
            await api.check_health()
        assert slow.calls == (3 if dead else len(delays))
        assert time.monotonic() - t0 < 3 * 0.3 + 2 * 0.05 + 1.0
    finally:
        await session.close()
        await runner.cleanup()


async def test_a_server_that_is_gone_is_dead_after_the_window(model_dir):
    config = RemoteEngineConfig(base_url="http://127.0.0.1:9", model="m", model_dir=str(model_dir),
                                health_failures=2, health_retry_s=0.05)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineError, match="failed 2 health probes"):
            await ServerApi(session, config, "gone").check_health()
