"""Sessions through the agent endpoint stay on one of two real vLLM servers behind an ``EnginePool``; when that
server dies, a session pinned to it moves to the other and its next call succeeds.

Two servers are started for the module (~30 s each on a 2-core machine): ``server_a`` (conftest.py) and
``server_b``, which the test kills.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from asyncrl.engines.pool import EnginePool, PoolConfig
from asyncrl.engines.vllm_remote import RemoteVLLMEngine
from asyncrl.engines.vllm_remote.process import ServerProcess
from tests.support.agents import TOOLS, client, endpoint_on
from tests.support.remote_engine import _cfg, served

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]
MODEL = "asyncrl-policy"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server_b(remote_model_dir: Path) -> AsyncIterator[ServerProcess]:
    async for server in served(remote_model_dir):
        yield server


async def _turn(oai: Any, messages: list[dict[str, Any]]) -> None:
    """One agent turn: a chat call, its reply and a tool result appended to ``messages``."""
    r = await oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, seed=1)
    m = r.choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "7"} if m.tool_calls else
                    {"role": "user", "content": "1+1="})


async def test_sessions_stick_to_a_server_and_move_when_it_dies(server_a: ServerProcess, server_b: ServerProcess,
                                                                 remote_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(remote_model_dir))
    members = [await RemoteVLLMEngine.connect(_cfg(s, remote_model_dir, health_retry_s=0.2), name=n)
               for s, n in ((server_a, "a"), (server_b, "b"))]
    pool = EnginePool(members, PoolConfig(drop_dead=True))
    try:
        async with endpoint_on(pool, tokenizer) as ep:
            keys = [f"s{i}" for i in range(4)]
            agents = {k: (client(ep.open_session(k)), [{"role": "user", "content": f"{i}+3="}])
                      for i, k in enumerate(keys)}
            for _ in range(3):  # three rounds of turns, the sessions' calls interleaved
                for k in keys:
                    await _turn(*agents[k])
            pinned = {k: pool._sessions[k].engine.name for k in keys}
            assert sorted(pinned.values()) == ["a", "a", "b", "b"], pinned  # spread, then sticky:
            served_by = {m.name: m.metrics()["engine/requests"] for m in members}
            assert served_by == {"a": 6, "b": 6}, served_by  # each server got its two sessions' calls only
            assert pool.session_moves == 0

            server_b.kill()
            moved = next(k for k in keys if pinned[k] == "b")
            await _turn(*agents[moved])  # its server is gone: the call moves and succeeds
            assert pool.session_moves == 1 and pool._sessions[moved].engine.name == "a"
            assert pool.live == ("a",)
            await _turn(*agents[moved])  # and stays on its new server
            assert pool.session_moves == 1
            sessions = {k: ep.close_session(k) for k in keys}
            assert not pool._sessions  # closed sessions are forgotten
            for oai, _ in agents.values():
                await oai.close()
        s = sessions[moved]
        assert (s.counters.calls, s.counters.splits) == (5, 0) and len(s.trajectories()) == 1
    finally:
        await pool.close()
