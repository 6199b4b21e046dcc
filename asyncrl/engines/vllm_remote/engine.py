"""All three engine roles over a vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.26 and newer).

Generation streams ``POST /v1/completions`` (token-id prompt, ``logprobs=0``, ``return_token_ids``), one HTTP
request per sample so each has its own seed and can be aborted alone. Start the server with
``--logprobs-mode processed_logprobs`` so the log-probs are those of the distribution actually sampled.
Cancelling ``generate`` closes its streams and aborts the requests on the server (``/abort_requests``): a
request frozen by a ``keep`` pause never notices a closed connection.

Version spans: the server's /v1/completions does not report weight versions (0.32 stamps them only on its
/inference/v1/generate endpoint; 0.26 not at all), so this engine tags each streamed chunk with its own
version at the moment the chunk arrives. A request that runs across a ``keep`` pause gets two spans, split
at the number of tokens received when ``load`` bumped the version. Between the pause and the bump the server
samples nothing, so the split is exact unless a chunk sampled before the pause was still in transit when the
version changed (the gap is the whole staging + reload, tens of milliseconds at least).

Weights reach the server through the engine's one transport (``transports.base``), as its config declares:
by default a safetensors directory (same machine, CPU or GPU) that it reloads through ``/collective_rpc``
(asyncrl's worker extension when the server loaded it: it keeps tied weights tied; else vLLM's
``reload_weights``); with ``RemoteEngineConfig.nccl``, a broadcast through vLLM's NCCL weight-transfer backend
(``nccl.NcclTransport``); with ``RemoteEngineConfig.lora``, LoRA adapters loaded at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.aio import TaskOwner, settle, together
from asyncrl.config import SamplingConfig
from asyncrl.engines.common import completion_room
from asyncrl.engines.death import Death
from asyncrl.engines.protocols import BehaviourPrecision, Engine, WeightUpdate, request_seed
from asyncrl.engines.vllm_remote.api import ServerApi, ServerInfo, ServerStatusError, server_info
from asyncrl.engines.lora.transport import AdapterTransport, ServedAdapter
from asyncrl.engines.transports.base import WeightTransport, check_carries
from asyncrl.engines.lora.server import RemoteAdapterPort
from asyncrl.engines.transports.files import FileTransport
from asyncrl.engines.vllm_remote.config import RemoteEngineConfig, check_paths
from asyncrl.engines.vllm_remote.nccl import NcclTransport
from asyncrl.engines.vllm_remote.streaming import SampleBuilder, SseReader
from asyncrl.engines.weights import manifest_dtype, read_manifest
from asyncrl.errors import EngineError, PromptRejected
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0  # best-effort server-side abort of a cancelled request
_READ_BUFSIZE = 4 * 2**20  # the first streamed chunk echoes the prompt ids; long prompts make long lines
# Idle connections are dropped well before the server's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so
# that reusing one the server is closing is rare; stalls can still make it happen (ServerApi.send resends).
_KEEPALIVE_S = 2.0
# After a pause call was cut short the server may still apply it after our resume (its handler runs on): check
# this many times, this far apart, and resume again if it did. Nothing on the server signals it.
_RECHECKS_S = (0.05, 0.25, 1.0)


class RemoteVLLMEngine(Engine):
    """Sampler, weight target and lifecycle over a vLLM OpenAI server. Build it with ``await connect(cfg)``.

    ``connect`` assumes the server holds ``cfg.model_dir``'s weights, which are version 0. The engine never
    starts or stops the server (``vllm_remote.process.start_vllm_server`` does that).
    """

    def __init__(self, cfg: RemoteEngineConfig, api: ServerApi, info: ServerInfo, name: str) -> None:
        self._cfg = cfg
        self._api = api
        self._info = info
        self.name = name
        self._version = 0
        self._nccl: NcclTransport | None = None  # with RemoteEngineConfig.nccl: its group is formed at connect
        self._adapters: AdapterTransport | None = None  # with RemoteEngineConfig.lora
        self._transport = self._make_transport()
        self._inflight: dict[int, SampleBuilder] = {}  # open streams, by a counter (request ids may repeat)
        self._next_stream = 0
        self._requests = 0  # samples requested, ever
        self._pause_in_doubt = False  # a pause call was cut short: the server may apply it late
        self._closed = False
        self._death = Death()  # declared by the first health check that finds the server gone

    def _make_transport(self) -> WeightTransport:
        """The engine's one weight transport, as its configuration declares it."""
        manifest = read_manifest(self._cfg.model_dir)
        root = Path(self._cfg.staging_dir) if self._cfg.staging_dir else None
        if self._cfg.lora is not None:
            self._adapters = AdapterTransport(self.name, RemoteAdapterPort(self._api, root), manifest,
                                              self._cfg.lora, manifest_dtype(manifest))
            return self._adapters
        if self._cfg.nccl is not None:
            self._nccl = NcclTransport(self.name, self._api, self._cfg.nccl, manifest)
            return self._nccl
        return FileTransport(self.name, self._reload, self._cfg.model_dir, manifest_dtype(manifest), root=root)

    @classmethod
    async def connect(cls, cfg: RemoteEngineConfig, *, name: str | None = None) -> RemoteVLLMEngine:
        """Open a session to the server, check it serves ``cfg.model``, and set its weight version to 0."""
        check_paths(cfg)
        name = name or cfg.base_url
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        # limit=0: control calls (pause!) must never queue behind hundreds of open generation streams.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
                                        headers=headers)
        api = ServerApi(session, cfg, name)
        try:
            engine = cls(cfg, api, await server_info(api), name)
            await engine._set_version(0)
            if engine._nccl is not None:
                await engine._nccl.open()
        except BaseException:
            await api.close()
            raise
        log.info("connected to vLLM server %s (max_model_len %d)", cfg.base_url, engine.max_model_len)
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def config(self) -> RemoteEngineConfig:
        return self._cfg

    @property
    def behaviour_precision(self) -> BehaviourPrecision | None:
        return self._cfg.precision  # declared with the server's start (RemoteEngineConfig.precision)

    def metrics(self) -> dict[str, float]:
        """Gauges of this engine's client side."""
        return {"engine/inflight_requests": len(self._inflight),
                "engine/inflight_tokens": sum(b.num_tokens for b in self._inflight.values()),
                "engine/requests": self._requests}

    def inflight(self) -> dict[str, int]:
        """Tokens received so far by each open request, by request id ("{request_id}-{sample index}")."""
        return {b.request_id: b.num_tokens for b in self._inflight.values()}

    # -- sampling ----------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        max_tokens = completion_room(prompt_ids, self.max_model_len, params.max_tokens)
        self._raise_if_closed()
        # One request per sample: its own seed, and it can be aborted alone.
        return await together(*(self._one(self._body(prompt_ids, params, i, max_tokens, request_id))
                                for i in range(params.n if n is None else n)))

    def _body(self, prompt_ids: tuple[int, ...], params: SamplingConfig, index: int, max_tokens: int,
              request_id: str) -> dict[str, Any]:
        body = {
            "model": self._cfg.model, "prompt": list(prompt_ids), "n": 1, "max_tokens": max_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "seed": request_seed(params.seed, f"{request_id}-{index}"), "ignore_eos": params.ignore_eos,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,  # token ids per chunk: no tokenizer needed on this side
            "return_tokens_as_token_ids": True,  # spares the server detokenising each log-prob entry
            "stream": True, "request_id": f"{request_id}-{index}",
        }
        if params.stop_token_ids:  # vLLM's own field: turns end on ids, with no detokenising to match strings
            body["stop_token_ids"] = list(params.stop_token_ids)
        return body

    async def _one(self, body: dict[str, Any]) -> Sample:
        with self._hold_adapter() as adapter:
            if adapter is not None:  # the adapter is served as a model of its own; all its tokens are its version
                return await self._stream({**body, "model": adapter.name}, lambda: adapter.version)
            return await self._stream(body, lambda: self._version)

    def _hold_adapter(self) -> contextlib.AbstractContextManager[ServedAdapter | None]:
        return self._adapters.hold() if self._adapters is not None else contextlib.nullcontext()

    async def _stream(self, body: dict[str, Any], version: Callable[[], int]) -> Sample:
        """One streamed sample; each chunk is tagged with ``version()`` as it arrives."""
        request_id = body["request_id"]
        builder = SampleBuilder(self.name, request_id, version())
        stream = self._next_stream
        self._next_stream += 1
        self._inflight[stream] = builder
        self._requests += 1
        try:
            # No total timeout (a paused request waits as long as the pause); liveness probes instead.
            resp = await self._watched(self._api.send(
                "POST", f"{self._cfg.base_url}/v1/completions", json=body, read_bufsize=_READ_BUFSIZE,
                timeout=aiohttp.ClientTimeout(total=None)))
            async with resp:
                if resp.status != 200:
                    raise self._refusal(resp.status, await resp.text(), request_id)
                reader = SseReader(resp.content)
                while (event := await self._watched(reader.next_event())) is not None:
                    builder.add(event, version())
        except asyncio.CancelledError:
            # Closing the stream alone does not reach a request frozen by a ``keep`` pause: abort it too.
            await settle(self._abort_on_server(request_id), f"aborting {request_id}")  # awaited, even if re-cancelled
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(self.name, f"request {request_id} to {self._cfg.base_url} failed: {exc!r}") from exc
        finally:
            del self._inflight[stream]
        return builder.build(clean_end=reader.done)

    def _refusal(self, status: int, text: str, request_id: str) -> Exception:
        if status == 400:  # validation: the prompt (or its length) was refused
            return PromptRejected(f"engine {self.name} refused request {request_id}: {text[:500]}",
                                  too_long="maximum context length" in text)
        return ServerStatusError(self.name, f"request {request_id}: HTTP {status}: {text[:500]}", status)

    async def _abort_on_server(self, request_id: str) -> None:
        # The completions endpoint names the engine request "cmpl-{request_id}-{prompt index}" (0.26 and 0.32).
        try:
            await self._api.post("/abort_requests", body={"request_ids": [f"cmpl-{request_id}-0"]},
                                 timeout_s=_ABORT_TIMEOUT_S)
        except EngineError as exc:
            log.debug("abort of %s on %s failed: %s", request_id, self.name, exc)

    async def _watched(self, aw: Any) -> Any:
        """Await ``aw``; while it is pending, probe /health every ``health_check_interval_s``.

        A stream is silent while the server is paused, so silence alone proves nothing; failed probes do."""
        async with TaskOwner(f"{self.name}-watched") as owner:  # a failed probe cancels and awaits ``aw``
            task = owner.start(aw)
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._cfg.health_check_interval_s)
                if done:
                    return task.result()
                await self._probe()

    async def _probe(self) -> None:
        """A health check shared by every waiter (``ServerApi.probe_if_quiet``); a failure is the death."""
        try:
            await self._api.probe_if_quiet()
        except EngineError as exc:
            self._death.declare(exc)
            raise

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-prob of each token after the first given the tokens before it, at temperature 1 (for checks
        and evaluation, and what a publication is checked with: under the adapter served now, if any)."""
        self._raise_if_closed()
        with self._hold_adapter() as adapter:
            out = await self._api.post("/v1/completions", body={
                "model": self._cfg.model if adapter is None else adapter.name, "prompt": list(token_ids),
                "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "return_tokens_as_token_ids": True,
            })
        steps = out["choices"][0]["prompt_logprobs"][1:]
        return [float(step[str(tok)]["logprob"]) for tok, step in zip(token_ids[1:], steps, strict=True)]

    async def score(self, token_ids: Sequence[int]) -> dict[str, list[float]]:
        return {self.name: await self.prompt_logprobs(token_ids)}

    # -- weight target -------------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._raise_if_closed()
        mode = PauseMode(mode)
        params = {"mode": mode.value, "clear_cache": "true" if clear_cache else "false"}
        # ``wait`` returns only when every in-flight request has finished: no total timeout, probes instead.
        timeout = math.inf if mode is PauseMode.WAIT else None
        try:
            await self._watched(self._api.post("/pause", params=params, timeout_s=timeout))
        except BaseException:
            self._pause_in_doubt = True
            raise

    async def resume(self) -> None:
        self._raise_if_closed()
        await self._api.post("/resume")
        if self._pause_in_doubt:
            self._pause_in_doubt = False
            for delay in _RECHECKS_S:
                await asyncio.sleep(delay)
                if (await self._api.get("/is_paused")).get("is_paused"):
                    log.warning("%s applied a cut-short pause after the resume; resuming again", self.name)
                    await self._api.post("/resume")

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Check (and, for file reloads, stage) through the engine's transport before the pause. A pool member's
        staging is adopted."""
        check_carries(self.name, self._transport, update)  # a kind it does not carry: refused, nothing staged
        return await self._transport.stage(update)

    def release(self, update: WeightUpdate) -> None:
        self._transport.release(update)

    async def load(self, update: WeightUpdate) -> None:
        """Load a prepared update; runs to its end even if the caller is cancelled meanwhile."""
        self._raise_if_closed()
        await settle(self._load(update), f"loading version {update.version} into {self.name}")

    async def _load(self, update: WeightUpdate) -> None:
        await self._transport.load(update)
        await self._set_version(update.version)

    async def _reload(self, weights_dir: Path) -> None:
        await self._api.post("/collective_rpc", body={
            "method": self._info.reload_method, "kwargs": {"weights_path": str(weights_dir)},
            "timeout": self._cfg.request_timeout_s,
        })

    async def _set_version(self, version: int) -> None:
        if self._info.stamps_versions:
            try:
                await self._api.post("/update_weight_version", body={"new_version": str(version)})
            except EngineError as exc:  # informational on the server; our own version is the one we use
                log.warning("could not set weight version %d on %s: %s", version, self.name, exc)
        self._version = version

    # -- lifecycle -----------------------------------------------------------------------------------------

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise EngineError(self.name, "engine is closed")

    async def check_alive(self) -> None:
        self._raise_if_closed()
        try:
            await self._api.check_health()
        except EngineError as exc:
            self._death.declare(exc)
            raise

    async def wait_dead(self) -> EngineError:
        """A server's death has no signal but failed health probes: probe it every ``health_check_interval_s``
        (one probe per interval however many callers wait, and none while requests show it alive) until a
        probe, here or in any call, declares it dead or the engine is closed."""
        async with TaskOwner(f"{self.name}-probing") as owner:  # the prober ends with this call
            owner.start(self._probe_until_dead())
            return await self._death.wait()

    async def _probe_until_dead(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.health_check_interval_s)  # the probe period: HTTP is the only signal
            await self._probe()

    async def close(self) -> None:
        """Close the HTTP session and remove staged weights (the server keeps running). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._death.declare(EngineError(self.name, "engine is closed"))
        try:
            await self._transport.close()
        finally:
            await self._api.close()
