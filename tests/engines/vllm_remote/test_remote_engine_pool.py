"""EnginePool: its logic on in-memory fakes, then two real vLLM servers behind a pool (the last test kills one).

Two servers are started for the module (~30 s each on a 2-core machine): ``server_a`` (conftest.py) and
``server_b``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from asyncrl.engines.updates import InMemory
from asyncrl.config import SamplingConfig
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.pool import EnginePool, PoolConfig
from asyncrl.engines.protocols import Engine, EngineError, WeightUpdate, WeightUpdateError
from asyncrl.engines.vllm_remote import RemoteVLLMEngine
from asyncrl.engines.vllm_remote.process import ServerProcess
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.types import FinishReason, PauseMode
from tests.support.remote_engine import (
    PROMPT, SEQS, TOL, _cfg, _hf_logprobs, _max_diff, _perturbed, served,
)
from tests.support import apply_update, load_paused

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
aio = pytest.mark.asyncio(loop_scope="module")


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(remote_model_dir: Path) -> Path:
    return remote_model_dir


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server_b(model_dir: Path) -> AsyncIterator[ServerProcess]:
    async for server in served(model_dir):
        yield server


# -- helpers -------------------------------------------------------------------------------------------------


def _staging_dirs() -> set[str]:
    from asyncrl.engines.weights import STAGING_PREFIX, staging_root

    return {p.name for p in staging_root().iterdir() if p.name.startswith(STAGING_PREFIX)}


# -- EnginePool logic on fakes (milliseconds) ---------------------------------------------------------------


@aio
async def test_pool_balances_load_round_robin() -> None:
    engines = [FakeEngine(name=n, token_delay_s=0.001) for n in "abc"]
    pool = EnginePool(engines)
    params = SamplingConfig(n=2, max_tokens=5)
    await asyncio.gather(*(pool.generate((1, 2), params, f"r{i}") for i in range(6)))
    assert [e.requests for e in engines] == [2, 2, 2]
    assert pool.metrics() == {"engine/alive": 3, "engine/dead": 0, "engine/inflight_samples": 0,
                              "engine/sessions": 0, "engine/session_moves": 0}


@aio
async def test_pool_reports_or_drops_a_dead_member() -> None:
    a, b = FakeEngine(name="a"), FakeEngine(name="b")
    strict, tolerant = EnginePool([a, b]), EnginePool([a, b], PoolConfig(drop_dead=True))
    b.alive = False
    with pytest.raises(EngineError) as err:  # the first pick of a fresh pool is its second member
        await strict.generate((1, 2), SamplingConfig(n=1, max_tokens=2), "r")
    assert err.value.engine == "b"
    with pytest.raises(EngineError) as err:
        await apply_update(strict, WeightUpdate(1, InMemory({"w": torch.zeros(1)})))
    assert err.value.engine == "b" and "update to version 1" in str(err.value)
    assert (a.version, b.version, strict.version) == (1, 0, 0)  # a alone moved on

    (s,) = await tolerant.generate((1, 2), SamplingConfig(n=1, max_tokens=2), "r")  # b fails, a serves
    assert s.finish_reason is FinishReason.LENGTH and tolerant.live == ("a",)
    assert tolerant.metrics()["engine/dead"] == 1
    await apply_update(tolerant, WeightUpdate(2, InMemory({"w": torch.zeros(1)})))
    assert tolerant.version == 2
    with pytest.raises(WeightUpdateError, match=r"refused by \['a'\]"):
        await apply_update(tolerant, WeightUpdate(3, InMemory({"w": object()})))  # type: ignore[dict-item]
    assert tolerant.version == 2
    b.alive = a.alive = False
    with pytest.raises(EngineError, match="every engine stopped answering"):
        await tolerant.check_alive()


# -- two servers behind a pool (server_b is killed at the end) --------------------------------------------


@aio
async def test_pool_spreads_requests_and_updates_every_member(
        server_a: ServerProcess, server_b: ServerProcess, model_dir: Path, hf_model: torch.nn.Module) -> None:
    members = [await RemoteVLLMEngine.connect(_cfg(s, model_dir), name=n) for s, n in
               ((server_a, "a"), (server_b, "b"))]
    pool = EnginePool(members)
    try:
        assert isinstance(pool, Engine)
        params = SamplingConfig(n=2, max_tokens=8, seed=1)
        results = await asyncio.gather(*(pool.generate(PROMPT, params, f"p{i}") for i in range(6)))
        assert all(len(r) == 2 for r in results)
        assert all(m.metrics()["engine/requests"] >= 4 for m in members)  # both served requests

        learner = _perturbed(hf_model, seed=2)
        before = _staging_dirs()
        prepared = await pool.prepare(WeightUpdate(7, InMemory(state_dict_for_engine(learner))))
        assert len(_staging_dirs() - before) == 1, "N servers on one host share one staged copy"
        await load_paused(pool, prepared)
        assert pool.version == 7 and all(m.version == 7 for m in members)
        assert len(_staging_dirs() - before) == 1, "both hold the one copy as their good weights"
        want = _hf_logprobs(learner, SEQS[1])
        for m in members:
            assert _max_diff(await m.prompt_logprobs(SEQS[1]), want) < TOL
    finally:
        await pool.close()


@aio
async def test_a_pool_cancelled_mid_operation_leaves_no_task_behind(server_a: ServerProcess, server_b: ServerProcess,
                                                                   model_dir: Path) -> None:
    """Every task a pool and its members start has an owner that cancels and awaits it: a wait for a death
    (per-member waits and health probers) and requests frozen mid-stream, cancelled, leave nothing pending
    by the time each call returns."""
    members = [await RemoteVLLMEngine.connect(_cfg(s, model_dir), name=n) for s, n in
               ((server_a, "a"), (server_b, "b"))]
    pool = EnginePool(members, name="p")
    before = asyncio.all_tasks()
    owned = {"p-wait-dead", "a-probing", "b-probing", "a-watched", "b-watched"}  # the owners' task names
    left: list[set[asyncio.Task]] = []

    async def tracked(aw: Any) -> None:
        try:
            await aw
        finally:  # as the call returns: what it started must be done, not merely cancelled
            left.append({t for t in asyncio.all_tasks() - before if t.get_name() in owned})

    await pool.pause(PauseMode.KEEP, clear_cache=False)  # the requests' streams stay open, frozen
    try:
        calls = [asyncio.create_task(tracked(pool.wait_dead()))]
        calls += [asyncio.create_task(tracked(pool.generate(PROMPT, SamplingConfig(n=1, max_tokens=8), f"c{i}")))
                  for i in range(2)]  # round robin: one per member
        async with asyncio.timeout(30):  # a server's progress has no event to await: look every 10 ms
            while not owned <= {t.get_name() for t in asyncio.all_tasks()}:
                await asyncio.sleep(0.01)
        for call in calls:
            call.cancel()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        assert left == [set(), set(), set()]
    finally:
        await pool.resume()
        await pool.close()
    assert not {t for t in asyncio.all_tasks() - before if t.get_name() in owned}


@aio
async def test_killed_server_is_detected_and_dropped(server_a: ServerProcess, server_b: ServerProcess,
                                                     model_dir: Path) -> None:
    # Dead = 3 failed probes in a row, 0.2 s apart here: about 0.4 s per check once the server is gone.
    a = await RemoteVLLMEngine.connect(_cfg(server_a, model_dir, health_retry_s=0.2), name="a")
    b = await RemoteVLLMEngine.connect(_cfg(server_b, model_dir, health_retry_s=0.2), name="b")
    strict, tolerant = EnginePool([a, b]), EnginePool([a, b], PoolConfig(drop_dead=True))
    try:
        await strict.check_alive()
        server_b.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            await b.check_alive()
        assert err.value.engine == "b" and time.monotonic() - t0 < 5.0
        with pytest.raises(EngineError) as err:
            await strict.check_alive()
        assert err.value.engine == "b"

        # Requests routed to the dead member fail over to the live one; the dead one leaves the rotation.
        params = SamplingConfig(n=1, max_tokens=4, seed=1)
        results = await asyncio.gather(*(tolerant.generate(PROMPT, params, f"d{i}") for i in range(4)))
        assert all(len(r) == 1 for r in results)
        await tolerant.check_alive()
        assert tolerant.metrics()["engine/alive"] == 1 and tolerant.metrics()["engine/dead"] == 1
        assert tolerant.live == ("a",)
        assert time.monotonic() - t0 < 5.0
    finally:
        await a.close()
        await b.close()
