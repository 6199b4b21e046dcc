"""OpenAI's request and response shapes for ``/v1/chat/completions`` and ``/v1/completions``: requests checked
field by field (a 400 naming the field, in OpenAI's error shape), samples turned into response objects and
stream chunks. What the endpoint does with a request is in ``endpoint.py``."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from asyncrl.agents.chat import ParsedTurn
from asyncrl.types import FinishReason, Sample

ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": 'Bearer realm="asyncrl"'} if self.status == 401 else None
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=headers)


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True, slots=True)
class Request:
    """The fields of a completion request the endpoint acts on."""

    model: str
    n: int
    max_tokens: int | None
    temperature: float | None
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad("body", f"not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object")
    return body


def common_fields(body: Mapping[str, Any], max_n: int) -> Request:
    """The sampling fields both routes share; anything the endpoint cannot honour is refused by name."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "must be a non-empty string")
    n = _int(body, "n", 1, 1, max_n)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "must be > 0")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise bad("seed", f"must be an integer, got {seed!r}")
    stop, logprobs = _stop(body), _logprobs(body)
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "only the sampled tokens' log-probs are served: leave it 0")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"must be a boolean, got {stream!r}")
    options = body.get("stream_options") or {}
    return Request(model, n, max_tokens, temperature, 1.0 if top_p is None else top_p, seed, stop,
                   logprobs, stream, bool(isinstance(options, dict) and options.get("include_usage")))


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a non-empty string or a list of at most 4 of them")
    return tuple(stop)


def _logprobs(body: Mapping[str, Any]) -> bool:
    logprobs = body.get("logprobs", False)
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # /v1/completions: a count of alternatives
        if logprobs > 0:
            raise bad("logprobs", "only the sampled tokens' log-probs are served: use 0 (or true on chat)")
        return True
    if not isinstance(logprobs, bool):
        raise bad("logprobs", f"must be a boolean, got {logprobs!r}")
    return logprobs


def _int(body: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    value = default if value is None else value
    if type(value) is not int or not low <= value <= high:
        raise bad(name, f"must be an integer from {low} to {high}, got {value!r}")
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise bad(name, f"must be a number from {low} to {high}, got {value!r}")
    return float(value)


def messages_field(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"must be an object whose role is one of {list(ROLES)}")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id", "a tool message must name the call it answers")
    return messages


def tools_field(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function", {}).get("name"), str) for t in tools):
        raise bad("tools", "must be an array of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return tools


# -- responses ------------------------------------------------------------------------------------------


def finish_of(sample: Sample, turn: ParsedTurn | None = None) -> str:
    if turn is not None and turn.tool_calls:
        return "tool_calls"
    return "length" if sample.finish_reason is FinishReason.LENGTH else "stop"


def logprob_entries(tokens: Sequence[str], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)]


def tool_calls_json(turn: ParsedTurn, call_ids: Sequence[str]) -> list[dict[str, Any]]:
    return [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in zip(call_ids, turn.tool_calls, strict=True)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(kind: str, rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def sse(request: web.Request, chunks: Sequence[Mapping[str, Any]]) -> web.StreamResponse:
    """``chunks`` as server-sent events, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
