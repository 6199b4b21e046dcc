"""Chat messages to token ids, once, and back: the endpoint's only use of the chat template.

The first call of a trajectory renders its messages with the template (``prompt_ids``). A later call that
extends it is never rendered whole again: its prompt is the previous prompt, then the ids the model sampled,
exactly as sampled, then ``continuation`` ids for what the agent added after them (tool results, the user's
next turn). That is what makes trained ids the sampled ids.

The rule for the ids between a sampled turn and the next prompt (``continuation``): render the history
before the turn (``P``, with the generation prompt), the history with the turn (``A``) and the whole request
(``F``, with the generation prompt). The template's text for the turn is ``A[len(P):]``. If it starts with what
the model sampled (decoded with its special tokens), the rest of it is the template's closing the model did not
write (a newline after an end-of-turn token, an end-of-turn after a stop string): it is appended, out of the
loss. The new messages are ``F[len(A):]``. When the template renders the turn otherwise (it rewrites JSON
arguments, say), the sampled ids are still kept as they are and nothing of the template's rendering of the
turn is used; ``ChatCounters.template_mismatches`` counts it. When ``P`` is not a prefix of ``A``, or ``A``
of ``F`` (a template that rewrites earlier turns, as reasoning templates strip old thoughts), the call cannot
extend the trajectory and starts a new one (a split).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model wrote: ``arguments`` is its JSON text, as OpenAI sends it."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """A model turn as the agent sees it: its text, and the calls found in it."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@runtime_checkable
class ToolCallParser(Protocol):
    """How one model family writes function calls (vLLM's tool parsers play the same role)."""

    stop_tokens: tuple[str, ...]  # tokens that end a turn once a call is written (none: the model's end of turn)

    def parse(self, text: str) -> ParsedTurn:
        """The turn's content and calls; text without a call is all content."""
        ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5 and Hermes models write calls.
    A block that is not such JSON stays in the content (the agent sees what the model wrote)."""

    stop_tokens: tuple[str, ...] = ()
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for match in self._BLOCK.finditer(text):
            call = _json_call(match[1])
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:match.start()])
            last = match.end()
        kept.append(text[last:])
        return ParsedTurn("".join(kept).strip() if calls else text, tuple(calls))


def _for_template(message: Message) -> dict[str, Any]:
    """A message as chat templates expect it: OpenAI sends a call's arguments as JSON text, templates read them
    as a mapping (as vLLM's server hands them over)."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_for_template(c) for c in calls]
    return out


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        args = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": args}}


def _text(message: Message) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _json_call(raw: str) -> ToolCall | None:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get("arguments", {})
    return ToolCall(body["name"], args if isinstance(args, str) else json.dumps(args))


@dataclass(slots=True)
class ChatCounters:
    """What rendering met (the endpoint's metrics)."""

    template_mismatches: int = 0  # sampled turns the template would have written otherwise (kept as sampled)


class ChatRenderer:
    """A tokenizer's chat template (or ``template``, a Jinja string in its place) and a tool-call parser."""

    def __init__(self, tokenizer: Any, template: str | None = None, parser: ToolCallParser | None = None) -> None:
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: pass ChatRenderer(template=...)")
        self.tokenizer = tokenizer
        self.template = template
        self.parser = parser
        self.counters = ChatCounters()
        stops = parser.stop_tokens if parser is not None else ()
        self.stop_token_ids = tuple(self._single_id(t) for t in stops)

    def _single_id(self, token: str) -> int:
        ids = self.tokenizer.convert_tokens_to_ids([token])
        if len(ids) != 1 or ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"tool-call stop token {token!r} is not a single token of the tokenizer")
        return int(ids[0])

    def render(self, messages: Sequence[Message], tools: Sequence[Any] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [_for_template(m) for m in messages], tools=list(tools) if tools else None, chat_template=self.template,
            add_generation_prompt=generation, tokenize=False)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=not special)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Any] | None) -> tuple[int, ...]:
        """A new trajectory's prompt: the messages rendered once, with the generation prompt."""
        return self.encode(self.render(messages, tools, generation=True))

    def continuation(self, history: Sequence[Message], reply: Message, sampled: Sequence[int],
                     new: Sequence[Message], tools: Sequence[Any] | None) -> tuple[int, ...] | None:
        """Ids to append after the sampled ``reply`` turn for the ``new`` messages (module docstring), or None
        when the template does not render the request as an extension of the history."""
        before = self.render(history, tools, generation=True)
        turn = self.render([*history, reply], tools, generation=False)
        whole = self.render([*history, reply, *new], tools, generation=True)
        if not (turn.startswith(before) and whole.startswith(turn)):
            return None
        rendered = turn[len(before):]
        # What the model wrote: its ids decoded; or, when a stop string ended the turn, the text returned
        # (the stop string is in the ids, not in the text, and the template closes the text).
        wrote = next((w for w in (self.decode(sampled, special=True), _text(reply)) if w and rendered.startswith(w)),
                     None)
        if wrote is None:
            self.counters.template_mismatches += 1
        closing = rendered[len(wrote):] if wrote is not None else ""
        return self.encode(closing + whole[len(turn):])

    def parse(self, text: str) -> ParsedTurn:
        """What the agent receives for a sampled turn (its text without special tokens): content and calls."""
        return self.parser.parse(text) if self.parser is not None else ParsedTurn(text)
