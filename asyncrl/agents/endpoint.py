"""``AgentEndpoint``: an OpenAI-compatible HTTP server (aiohttp) in front of any ``Sampler``, recording what it
serves, by session.

Routes, each also under ``/sessions/{key}`` (the base URL a harness hands an agent, ``session_url``):

- ``POST /v1/chat/completions``: messages rendered by the ``ChatRenderer`` (the chat template applied once per
  trajectory), ``n``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``logprobs`` (the sampled
  tokens'), ``tools`` (calls parsed by the renderer's ``ToolCallParser``), ``stream``;
- ``POST /v1/completions``: a text (or token-id) prompt, the same fields;
- ``GET /v1/models``: the one served model;
- ``POST /sessions/{key}/reward``: ``{"reward": x}``, an episode's reward posted by whoever judges it.

A call belongs to a session through its URL or an ``X-Session-Id`` header; the session must have been opened
(``open_session``), so an agent's calls are never silently left out of its episode. Calls without a session are
served and counted, not recorded. Every answer is authenticated (``Authorization: Bearer``, as the openai client
sends its API key), bounded (``max_body_bytes``, ``max_n``) and every error has OpenAI's shape.

Streaming sends OpenAI's chunks, but only once the completion has ended: a ``Sampler`` returns whole samples.
Stop strings are matched here, on the decoded completion: the ids are cut after the token that completes the
string (they stay in the trajectory: the model's context is what it sampled), the text before it is returned.
A choice cut by an ``abort`` pause is sampled again from the same prompt (at most ``max_resubmits`` times), so
an agent never sees a publication; ``keep`` and ``wait`` need nothing, and every choice's version spans say
which weights produced which token. ``seed`` is mixed with each request's own id (as everywhere in asyncrl: a
group's samples must differ), so a seeded run is reproducible but two identical requests are not identical;
``temperature=0`` is. Each choice also carries, beside OpenAI's fields, ``asyncrl``:
``{"token_ids", "version_spans"}``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from asyncrl.agents import wire
from asyncrl.agents.chat import ChatRenderer, ParsedTurn
from asyncrl.agents.sessions import Session
from asyncrl.agents.stops import cut_at_stop
from asyncrl.config import SamplingConfig
from asyncrl.config_base import config
from asyncrl.engines.protocols import PromptRejected, Sampler
from asyncrl.errors import EngineError
from asyncrl.http.server import MiB, BearerAuth, HTTPError, check_token, read_body
from asyncrl.types import FinishReason, Sample

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
GREEDY = 1e-6  # what temperature 0 becomes: vLLM decodes greedily below 1e-5, SamplingConfig wants > 0


@config
class EndpointConfig:
    """The agent endpoint's address, token and limits."""

    token: Annotated[str, Field(description="bearer token every request must carry (the openai client's api_key)")]
    host: Annotated[str, Field(description="address to bind (loopback by default: put TLS in front otherwise)")] = (
        "127.0.0.1")
    port: Annotated[int, Field(strict=True, ge=0, le=65535, description="port to bind; 0 = a free one")] = 0
    model: Annotated[str, Field(description="the model name served and listed by /v1/models")] = "asyncrl-policy"
    max_body_bytes: Annotated[int, Field(strict=True, ge=1024, description="largest request body")] = 4 * MiB
    max_n: Annotated[int, Field(strict=True, ge=1, description="largest n a request may ask for")] = 16
    temperature: Annotated[float | None, Field(strict=True, gt=0, description=(
        "the policy's sampling temperature, overriding requests' temperature and top_p (training: the learner "
        "scores at it, with top_p 1); None serves each request's own"))] = None
    max_resubmits: Annotated[int, Field(strict=True, ge=0, description=(
        "times a choice cut by an abort pause is sampled again before the call fails with a 503"))] = 3

    def __post_init__(self) -> None:
        check_token("EndpointConfig.token", self.token)


@dataclass(slots=True)
class EndpointCounters:
    """The endpoint's books."""

    requests: int = 0
    errors: dict[int, int] = field(default_factory=dict)  # answers other than 200, by status
    calls: int = 0  # completions served
    unsessioned: int = 0  # of those, outside any session
    streamed: int = 0
    resubmitted: int = 0  # choices cut by an abort pause and sampled again
    stop_string_cuts: int = 0  # choices cut at a stop string


class AgentEndpoint:
    """The server; ``async with AgentEndpoint(...) as endpoint`` binds it, leaving closes it."""

    def __init__(self, sampler: Sampler, renderer: ChatRenderer, config: EndpointConfig) -> None:
        self.sampler = sampler
        self.renderer = renderer
        self.config = config
        self.counters = EndpointCounters()
        self.sessions: dict[str, Session] = {}
        self._auth = BearerAuth(config.token, "EndpointConfig.token", "agent endpoint")
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port = config.port

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def __aenter__(self) -> AgentEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for prefix in ("", "/sessions/{session}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._wrap(self._chat))
            app.router.add_post(f"{prefix}/v1/completions", self._wrap(self._completions))
            app.router.add_get(f"{prefix}/v1/models", self._wrap(self._models))
        app.router.add_post("/sessions/{session}/reward", self._wrap(self._reward))
        # A client that hangs up cancels its call (its engine requests are aborted, nothing is recorded): an
        # agent never saw that reply, so it must not become part of its trajectory.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("agent endpoint on %s", self.base_url)

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    # -- sessions -------------------------------------------------------------------------------------------

    def open_session(self, key: str) -> str:
        """Start recording ``key``'s calls; returns the base URL that puts calls in it."""
        if not key or "/" in key or key in self.sessions:
            raise ValueError(f"session key {key!r} is empty, holds '/', or is open already")
        self.sessions[key] = Session(key)
        return f"http://{self.config.host}:{self.port}/sessions/{key}/v1"

    def close_session(self, key: str) -> Session:
        """Stop recording ``key`` (later calls in it get a 404) and hand over what it recorded."""
        session = self.sessions.pop(key)
        session.closed = True
        self.sampler.end_session(key)
        return session

    def _session(self, request: web.Request) -> Session | None:
        key = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        if key is None:
            return None
        if key not in self.sessions:
            raise wire.OpenAIError(404, f"no open session {key!r}", param="session", code="session_not_found")
        return self.sessions[key]

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {"agent/calls": c.calls, "agent/requests": c.requests, "agent/errors": sum(c.errors.values()),
                "agent/resubmitted": c.resubmitted, "agent/stop_string_cuts": c.stop_string_cuts,
                "agent/template_mismatches": self.renderer.counters.template_mismatches}

    # -- routes ---------------------------------------------------------------------------------------------

    def _wrap(self, handler: Any) -> Any:
        async def route(request: web.Request) -> web.StreamResponse:
            self.counters.requests += 1
            try:
                self._auth.check(request)
                return await handler(request)
            except HTTPError as exc:  # auth (401) and body size (413)
                error = wire.OpenAIError(exc.status, exc.message, kind="invalid_request_error")
            except wire.OpenAIError as exc:
                error = exc
            except PromptRejected as exc:
                error = wire.OpenAIError(400, str(exc), param="messages",
                                         code="context_length_exceeded" if exc.too_long else "invalid_prompt")
            except EngineError as exc:
                error = wire.OpenAIError(503, str(exc), kind="server_error", code="engine_unavailable")
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.path)
                error = wire.OpenAIError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
            self.counters.errors[error.status] = self.counters.errors.get(error.status, 0) + 1
            return error.response()

        return route

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "asyncrl",
             "max_model_len": self.sampler.max_model_len}]})

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = wire.parse_body(await read_body(request, 64 * 1024))
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise wire.bad("reward", f"must be a finite number, got {reward!r}")
        assert session is not None  # the route has a session in its path
        session.reward = float(reward)
        return web.json_response({"session": session.key, "reward": session.reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = wire.parse_body(await read_body(request, self.config.max_body_bytes))
        req = wire.common_fields(body, self.config.max_n)
        messages, tools = wire.messages_field(body), wire.tools_field(body)
        session = self._session(request)
        try:
            if session is not None:
                prompt, parent, added = session.prompt_for(self.renderer, messages, tools)
            else:
                prompt, parent, added = self.renderer.prompt_ids(messages, tools), None, ()
        except Exception as exc:  # the template refused the messages (a role order it does not allow, say)
            raise wire.bad("messages", f"the chat template cannot render them: {exc}") from exc
        samples, texts = await self._serve(request, session, prompt, req)
        turns = [self.renderer.parse(t) for t in texts]
        if session is not None:
            session.record(messages, prompt, parent, added, samples, turns)
        return await self._answer_chat(request, req, prompt, samples, turns)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = wire.parse_body(await read_body(request, self.config.max_body_bytes))
        req = wire.common_fields(body, self.config.max_n)
        text = body.get("prompt")
        if not (isinstance(text, str) and text) and not (
                isinstance(text, list) and text and all(type(t) is int and t >= 0 for t in text)):
            raise wire.bad("prompt", "must be one non-empty string or one array of token ids")
        session = self._session(request)
        if session is not None:
            prompt, parent, added = session.text_prompt_for(self.renderer, text)
        else:
            prompt, parent, added = (self.renderer.encode(text) if isinstance(text, str) else tuple(text)), None, ()
        samples, texts = await self._serve(request, session, prompt, req)
        turns = [ParsedTurn(t) for t in texts]  # completions carry no tool calls
        if session is not None:
            session.record(text, prompt, parent, added, samples, turns)
        return await self._answer_text(request, req, prompt, samples, turns)

    # -- sampling -------------------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, session: Session | None, prompt: tuple[int, ...],
                     req: wire.Request) -> tuple[list[Sample], list[str]]:
        """Sample the call's choices; returns them with the text each shows the agent."""
        room = self.sampler.max_model_len - len(prompt)
        if room <= 0:
            raise wire.OpenAIError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                                        f"{self.sampler.max_model_len}", param="messages",
                                   code="context_length_exceeded")
        if self.config.temperature is not None:  # training: sampled exactly as the learner scores
            temperature, top_p = self.config.temperature, 1.0
        else:  # OpenAI's defaults; 0 is greedy
            temperature = 1.0 if req.temperature is None else req.temperature or GREEDY
            top_p = req.top_p
        params = SamplingConfig(n=req.n, max_tokens=min(req.max_tokens or room, room), temperature=temperature,
                                top_p=top_p, seed=req.seed, stop_token_ids=self.renderer.stop_token_ids)
        sampler = self.sampler.for_session(session.key) if session is not None else self.sampler
        rid = f"agent-{session.key if session else 'none'}-{next(self._ids)}"
        samples = await self._sample(sampler, prompt, params, rid)
        texts = [self.renderer.decode(s.token_ids) for s in samples]  # what the agent sees
        for i, s in enumerate(samples):
            if req.stop and (cut := cut_at_stop(s, req.stop, self.renderer)) is not None:
                samples[i], texts[i] = cut
                self.counters.stop_string_cuts += 1
        self.counters.calls += 1
        self.counters.unsessioned += session is None
        self.counters.streamed += req.stream
        return samples, texts

    async def _sample(self, sampler: Sampler, prompt: tuple[int, ...], params: SamplingConfig,
                      rid: str) -> list[Sample]:
        samples = await sampler.generate(prompt, params, rid, params.n)
        for attempt in range(1, self.config.max_resubmits + 2):
            cut = [i for i, s in enumerate(samples) if s.finish_reason is FinishReason.ABORT]
            if not cut:
                return samples
            if attempt > self.config.max_resubmits:
                break
            self.counters.resubmitted += len(cut)
            again = await sampler.generate(prompt, params, f"{rid}/r{attempt}", len(cut))
            for i, s in zip(cut, again, strict=True):
                samples[i] = s
        raise wire.OpenAIError(503, f"cut by abort pauses {self.config.max_resubmits + 1} times in a row "
                                    "(EndpointConfig.max_resubmits)", kind="server_error", code="aborted")

    # -- answers --------------------------------------------------------------------------------------------

    def _call_ids(self, rid: str, turn: ParsedTurn) -> list[str]:
        return [f"call_{rid[-12:]}_{i}" for i in range(len(turn.tool_calls))]

    def _extension(self, sample: Sample) -> dict[str, Any]:
        return {"token_ids": list(sample.token_ids),
                "version_spans": [[v.version, v.start, v.end] for v in sample.version_spans]}

    def _logprobs(self, sample: Sample) -> list[dict[str, Any]]:
        tokens = [self.renderer.decode([t], special=True) for t in sample.token_ids]
        return wire.logprob_entries(tokens, sample.logprobs)

    async def _answer_chat(self, request: web.Request, req: wire.Request, prompt: tuple[int, ...],
                           samples: Sequence[Sample], turns: Sequence[ParsedTurn]) -> web.StreamResponse:
        rid = wire.new_id("chatcmpl")
        use = wire.usage(len(prompt), sum(len(s.token_ids) for s in samples))
        choices = []
        for i, (s, t) in enumerate(zip(samples, turns, strict=True)):
            message: dict[str, Any] = {"role": "assistant", "content": t.content or None}
            if t.tool_calls:
                message["tool_calls"] = wire.tool_calls_json(t, self._call_ids(f"{rid}{i}", t))
            choices.append({"index": i, "message": message, "finish_reason": wire.finish_of(s, t),
                            "logprobs": {"content": self._logprobs(s)} if req.logprobs else None,
                            "asyncrl": self._extension(s)})
        if not req.stream:
            return web.json_response({**wire.envelope("chat.completion", rid, req.model), "choices": choices,
                                      "usage": use})
        return await wire.sse(request, self._chat_chunks(rid, req, samples, turns, choices, use))

    def _chat_chunks(self, rid: str, req: wire.Request, samples: Sequence[Sample], turns: Sequence[ParsedTurn],
                     choices: list[dict[str, Any]], use: dict[str, int]) -> list[dict[str, Any]]:
        head = wire.envelope("chat.completion.chunk", rid, req.model)
        chunks = []
        for i, (s, t, c) in enumerate(zip(samples, turns, choices, strict=True)):
            chunks.append({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}]})
            whole = not t.tool_calls and t.content == self.renderer.decode(s.token_ids)
            pieces = self._pieces(s) if whole else [(t.content, s.token_ids)]
            done = 0
            for text, ids in pieces:
                lp = c["logprobs"] and {"content": c["logprobs"]["content"][done:done + len(ids)]}
                done += len(ids)
                chunks.append({**head, "choices": [{"index": i, "delta": {"content": text}, "finish_reason": None,
                                                    "logprobs": lp or None}]})
            if t.tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(c["message"]["tool_calls"])]
                chunks.append({**head, "choices": [{"index": i, "delta": {"tool_calls": calls},
                                                    "finish_reason": None, "logprobs": None}]})
            chunks.append({**head, "choices": [{"index": i, "delta": {}, "finish_reason": c["finish_reason"],
                                                "logprobs": None, "asyncrl": c["asyncrl"]}]})
        if req.include_usage:
            chunks.append({**head, "choices": [], "usage": use})
        return chunks

    def _pieces(self, sample: Sample) -> list[tuple[str, tuple[int, ...]]]:
        """The completion's text token by token (a token that ends inside a character waits for the next)."""
        out, start, shown = [], 0, ""
        for k in range(1, len(sample.token_ids) + 1):
            text = self.renderer.decode(sample.token_ids[:k])
            if k == len(sample.token_ids) or not text.endswith("\ufffd"):
                out.append((text[len(shown):], sample.token_ids[start:k]))
                start, shown = k, text
        return out

    async def _answer_text(self, request: web.Request, req: wire.Request, prompt: tuple[int, ...],
                           samples: Sequence[Sample], turns: Sequence[ParsedTurn]) -> web.StreamResponse:
        rid = wire.new_id("cmpl")
        use = wire.usage(len(prompt), sum(len(s.token_ids) for s in samples))
        choices = []
        for i, (s, t) in enumerate(zip(samples, turns, strict=True)):
            lp = None
            if req.logprobs:
                entries = self._logprobs(s)
                lp = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                      "top_logprobs": None, "text_offset": None}
            choices.append({"index": i, "text": t.content, "finish_reason": wire.finish_of(s), "logprobs": lp,
                            "asyncrl": self._extension(s)})
        envelope = wire.envelope("text_completion", rid, req.model)
        if not req.stream:
            return web.json_response({**envelope, "choices": choices, "usage": use})
        chunks = [{**envelope, "choices": [c]} for c in choices]
        if req.include_usage:
            chunks.append({**envelope, "choices": [], "usage": use})
        return await wire.sse(request, chunks)
