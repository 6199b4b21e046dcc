"""A request the server never read is resent; anything else that cuts a connection stays an error.

uvicorn closes a kept-alive connection when its keep-alive timer fires, even with our next request already on
the way: it runs due timers before reading. With the client and the server both stalled for seconds (2 cores
beside CPU burners), that request failed with ``ServerDisconnectedError`` (seen in ``test_pause_abort_cuts_samples``
against a real server). A loopback server reproduces it here on demand, in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.config import SamplingConfig
from asyncrl.engines.vllm_remote import RemoteEngineConfig, RemoteVLLMEngine
from asyncrl.errors import EngineError
from asyncrl.types import FinishReason, PauseMode

_CHUNK = {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
                       "logprobs": {"token_logprobs": [-0.5, -0.25]}, "finish_reason": "length"}]}
STREAM = f"data: {json.dumps(_CHUNK)}\n\ndata: [DONE]\n\n".encode()
ROUTES = {  # path -> response body (every answer is a 200)
    "/v1/models": json.dumps({"data": [{"id": "m", "max_model_len": 64}]}).encode(),
    "/weight_info": b"{}", "/collective_rpc": b"{}", "/update_weight_version": b"{}", "/health": b"",
    "/pause": b"{}", "/resume": b"{}", "/is_paused": b'{"is_paused": false}', "/v1/completions": STREAM,
}


class KeepAliveServer:
    """HTTP/1.1 on loopback that keeps connections alive. ``drop_reused``: how many of the next requests that
    arrive on a reused connection it drops unread (closing that connection, as uvicorn's keep-alive timer
    does); ``drop_all``: drop every request; ``cut_streams``: send half of each completion body, then close."""

    def __init__(self) -> None:
        self.drop_reused = 0
        self.drop_all = False
        self.cut_streams = False
        self.log: list[tuple[str, bool, str]] = []  # (path, on a reused connection, what happened)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reused = False
        self._writers.add(writer)
        try:
            while (head := await _read_request(reader)) is not None:
                path = head.split(b" ")[1].split(b"?")[0].decode()
                drop = self.drop_all or (reused and self.drop_reused > 0)
                if drop and not self.drop_all:
                    self.drop_reused -= 1
                if drop:
                    self.log.append((path, reused, "dropped"))
                    return
                body = ROUTES[path]
                cut = self.cut_streams and path == "/v1/completions"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                             + (body[:len(body) // 2] if cut else body))
                await writer.drain()
                self.log.append((path, reused, "cut" if cut else "answered"))
                if cut:
                    return
                reused = True
        finally:
            self._writers.discard(writer)
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The request line and headers of the next request (its body read and discarded); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"vocab_size": 16}')  # connect reads the vocabulary the server accepts
    return tmp_path


async def _connect(server: KeepAliveServer, model_dir: Path) -> RemoteVLLMEngine:
    url = await server.start()
    cfg = RemoteEngineConfig(base_url=url, model="m", model_dir=str(model_dir), health_retry_s=0.01)
    return await RemoteVLLMEngine.connect(cfg, name="ka")


PARAMS = SamplingConfig(n=1, max_tokens=2)


async def test_a_request_dropped_unread_on_a_kept_alive_connection_is_resent(model_dir: Path) -> None:
    server = KeepAliveServer()
    engine = await _connect(server, model_dir)
    try:
        for path, call in (("/v1/completions", lambda: engine.generate((1, 2), PARAMS, "r")),
                           ("/pause", lambda: engine.pause(PauseMode.ABORT, clear_cache=True)),
                           ("/resume", engine.resume)):
            await engine.check_alive()  # leaves one kept-alive connection in the pool
            server.drop_reused, server.log[:] = 1, []
            result = await call()
            # Dropped unread on the reused connection, then answered on a new one.
            assert server.log == [(path, True, "dropped"), (path, False, "answered")]
            if path == "/v1/completions":
                (sample,) = result
                assert (sample.token_ids, sample.finish_reason) == ((5, 6), FinishReason.LENGTH)
        assert engine.metrics()["engine/inflight_requests"] == 0
    finally:
        await engine.close()
        await server.stop()


async def test_a_server_that_drops_cuts_or_is_gone_is_an_error(model_dir: Path) -> None:
    server = KeepAliveServer()
    engine = await _connect(server, model_dir)
    try:
        async with asyncio.timeout(30):  # no hang: one resend at most
            server.drop_all = True
            with pytest.raises(EngineError, match="ServerDisconnectedError"):
                await engine.generate((1, 2), PARAMS, "dropped")
            assert [reused for _, reused, _ in server.log[-2:]] == [True, False]
            server.drop_all, server.cut_streams = False, True
            with pytest.raises(EngineError, match="request cut-0"):  # a stream cut mid-way is not resent
                await engine.generate((1, 2), PARAMS, "cut")
            assert server.log[-1][2] == "cut" and [e[2] for e in server.log].count("cut") == 1
            await server.stop()
            with pytest.raises(EngineError):
                await engine.generate((1, 2), PARAMS, "gone")
    finally:
        await engine.close()
