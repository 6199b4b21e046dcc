"""Helpers shared by the embedded-service tests (not fixtures): a ``FakeEngine`` that checks updates as vLLM does,
weights for it, and ``EngineControl``'s routes on a real aiohttp server with a client for them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import torch
from aiohttp import web
from safetensors.torch import save_file

from asyncrl.engines.embedded import EngineControl
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.protocols import Engine, StagedInEngine, WeightUpdate
from asyncrl.engines.weights import ParamSpec, stage, validate_update
from asyncrl.types import PauseMode

TOKEN = "control-s3cret"
WAIT_S = 5.0  # bound on any awaited event in the fast tests


class CheckedFakeEngine(FakeEngine):
    """A FakeEngine that validates updates against a manifest in ``prepare``, as VLLMEngine does, and records
    what the control routes asked of it. ``gate``, when set, holds every load until it opens."""

    def __init__(self, manifest: dict[str, ParamSpec], gate: asyncio.Event | None = None) -> None:
        super().__init__()
        self.manifest = manifest
        self.gate = gate
        self.loading = asyncio.Event()  # set once a load has begun
        self.prepared: list[int] = []  # versions prepared
        self.prepared_while_paused: list[int] = []  # the pause should cover only the load
        self.released: list[int] = []  # versions released (once each, loaded or not)
        self.calls: list[str] = []  # pause, load, resume and close, in order

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        validate_update(update.tensors, self.manifest)
        self.prepared.append(update.version)
        if not self._running.is_set():
            self.prepared_while_paused.append(update.version)
        return replace(update, staged=StagedInEngine(update.version))

    def release(self, update: WeightUpdate) -> None:
        self.released.append(update.version)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self.calls.append("pause")
        await super().pause(mode, clear_cache)

    async def load(self, update: WeightUpdate) -> None:
        assert update.staged == StagedInEngine(update.version), "loaded an update that was not prepared"
        self.calls.append(f"load{update.version}")
        self.loading.set()
        if self.gate is not None:
            await self.gate.wait()
        await super().load(update)

    async def resume(self) -> None:
        self.calls.append("resume")
        await super().resume()

    async def close(self) -> None:
        self.calls.append("close")
        await super().close()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(3, generator=g)}


def model_with_weights(tmp_path: Path) -> Path:
    """A model folder holding ``weights()``: what the service's engine started from."""
    out = tmp_path / "model"
    out.mkdir()
    save_file(weights(), str(out / "model.safetensors"))
    return out


def staged(tensors: dict[str, torch.Tensor], root: Path) -> str:
    return str(stage(tensors, torch.float32, root).path)


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": "world"})


@asynccontextmanager
async def control_server(engine: Engine | None, *, on_response: Callable[[web.StreamResponse], None] | None = None,
                         **kwargs: Any) -> AsyncIterator[tuple[str, EngineControl]]:
    """A host app with one route of its own and the control routes, on an ephemeral loopback port."""
    control = EngineControl(engine, TOKEN, **kwargs)
    app = web.Application()
    app.add_routes([web.get("/hello", hello)] + control.routes())
    if on_response is not None:
        async def prepared(request: web.Request, response: web.StreamResponse) -> None:
            on_response(response)

        app.on_response_prepare.append(prepared)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", control
    finally:
        await control.close()
        await runner.cleanup()


async def call(url: str, method: str, path: str, body: Any = None, *, token: str | None = TOKEN,
               raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, f"{url}/asyncrl/{path}", headers=headers,
                             data=raw if raw is not None else None if body is None else json.dumps(body)) as resp:
            return resp.status, await resp.json()
