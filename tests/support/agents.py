"""Shared by the agent endpoint tests (not fixtures): a chat template and a tool-call parser the tiny arithmetic
tokenizer can render (it knows digits, ``+``, ``=`` and its special tokens only), an endpoint started on a
sampler, a sampler that never stops at end of sequence (so a pause finds a call running), and a multi-turn agent
written with the ``openai`` client alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from asyncrl.agents import AgentEndpoint, ChatRenderer, EndpointConfig, ParsedTurn, ToolCall
from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import Sampler
from asyncrl.types import Sample

TOKEN = "agent-test-token"

# user: ``<s>{content}``; tool result: ``<s>{content}=``; assistant: its call's ``text`` argument (or its content),
# then ``</s>``. No generation prompt: an assistant turn follows the last message directly.
TEMPLATE = ("{%- for m in messages -%}"
            "{%- if m.role == 'assistant' -%}"
            "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}{{ c.function.arguments.text }}{%- endfor -%}"
            "{%- else -%}{{ m.content }}{%- endif -%}{{ eos_token }}"
            "{%- elif m.role == 'tool' -%}<s>{{ m.content }}="
            "{%- else -%}<s>{{ m.content }}{%- endif -%}{%- endfor -%}")

TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]


class Echo:
    """Every non-empty turn is one call of ``echo`` whose ``text`` argument is the turn's text."""

    stop_tokens: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn("", (ToolCall("echo", json.dumps({"text": text})),)) if text else ParsedTurn(text)


def renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer, TEMPLATE, Echo())


@asynccontextmanager
async def endpoint_on(sampler: Any, tokenizer: Any, **config: Any) -> AsyncIterator[AgentEndpoint]:
    """An endpoint in front of ``sampler``, bound to a free loopback port, closed on leaving."""
    async with AgentEndpoint(sampler, renderer(tokenizer), EndpointConfig(token=TOKEN, **config)) as endpoint:
        yield endpoint


def client(base_url: str, token: str = TOKEN, **kw: Any) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, **kw)


async def echo_agent(base_url: str, task: str, turns: int = 3, seed: int = 0, max_tokens: int = 6,
                     **create: Any) -> list[Any]:
    """An agent as a user would write it: ``turns`` chat calls, each reply appended to the history as the client
    returns it, then a tool result for its call (or a user turn when it made none). Returns the responses."""
    oai = client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    out = []
    try:
        for turn in range(turns):
            r = await oai.chat.completions.create(model="asyncrl-policy", messages=messages, tools=TOOLS,
                                                  max_tokens=max_tokens, logprobs=True, temperature=1.0,
                                                  seed=seed + turn, **create)
            out.append(r)
            m = r.choices[0].message
            messages.append(m.model_dump(exclude_none=True))
            if m.tool_calls:
                messages.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "7"})
            else:
                messages.append({"role": "user", "content": "1+1="})
    finally:
        await oai.close()
    return out


class EndlessSampler(Sampler):
    """``sampler`` with end of sequence ignored, and an event set once a call reaches it: a long call then runs
    for all its ``max_tokens``, so a pause lands while it generates."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.name = f"endless[{sampler.name}]"
        self.called = asyncio.Event()

    version = property(lambda self: self.sampler.version)
    max_model_len = property(lambda self: self.sampler.max_model_len)
    vocab_size = property(lambda self: self.sampler.vocab_size)
    behaviour_precision = property(lambda self: self.sampler.behaviour_precision)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        call = self.sampler.generate(prompt_ids, replace(params, ignore_eos=True), request_id, n)
        self.called.set()
        return await call
