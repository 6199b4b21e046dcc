"""Sessions: the calls of one agent episode, joined into token-exact trajectories.

Every call is recorded (``CallRecord``: prompt ids, and per choice the sampled ids, log-probs, version spans and
finish reason). A call whose messages extend an open branch (a choice an earlier call returned, followed by
what the agent added) continues that branch: its prompt is the branch's context, the sampled ids as sampled,
then the ``ChatRenderer.continuation`` ids, which enter the trajectory out of the loss. Any other call starts a
new branch from its messages rendered once; after the first call that is a split (the agent rewrote its
history), counted in ``SessionCounters.splits``.

A branch that no later call continued is a finished trajectory (``Session.trajectories``): one per episode
when the agent never rewrites its history and asks for one choice at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.chat import ChatRenderer, Message, ParsedTurn
from asyncrl.episodes.trajectory import TrajectoryBuilder
from asyncrl.types import FinishReason, Sample, Trajectory


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One completion call, as served."""

    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]  # one per choice
    extended: bool  # continued an earlier branch (False: rendered from its messages)


@dataclass(slots=True)
class Branch:
    """A trajectory in progress: its first prompt, its turns and continuations, and what it last answered."""

    prompt_ids: tuple[int, ...]
    builder: TrajectoryBuilder
    sampled: tuple[int, ...]  # the ids of its last turn
    finish: FinishReason  # how that turn ended
    messages: list[dict[str, Any]] | None = None  # chat: the request messages of its last call, normalised
    reply: dict[str, Any] | None = None  # chat: the assistant message it returned, normalised
    text: str | None = None  # completions: its last prompt and the text returned, joined
    open: bool = True  # no later call has continued it

    @property
    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.builder.token_ids)

    def trajectory(self) -> tuple[tuple[int, ...], Trajectory]:
        return self.prompt_ids, self.builder.build(self.finish)


@dataclass(slots=True)
class SessionCounters:
    """One session's books (the endpoint adds every session's into its own)."""

    calls: int = 0
    extensions: int = 0  # calls that continued a branch
    splits: int = 0  # calls after the first that could not: the history was rewritten
    prompt_tokens: int = 0  # tokens rendered from messages (first prompts and continuations)
    sampled_tokens: int = 0


@dataclass(slots=True)
class Session:
    """One episode's calls. Not thread-safe: the endpoint serves a session's calls on one event loop."""

    key: str
    calls: list[CallRecord] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)
    counters: SessionCounters = field(default_factory=SessionCounters)
    reward: float | None = None  # posted to the session's reward route, if the harness asks for one there
    closed: bool = False

    def prompt_for(self, renderer: ChatRenderer, messages: Sequence[Message], tools: Sequence[Any] | None
                   ) -> tuple[tuple[int, ...], Branch | None, tuple[int, ...]]:
        """The prompt ids of a call, the branch it continues (None: a new one) and the ids it adds to it."""
        norm = [normalise(m) for m in messages]
        for branch in reversed(self.branches):
            if not branch.open or branch.messages is None:
                continue
            k = len(branch.messages)
            if len(norm) <= k + 1 or norm[:k] != branch.messages or norm[k] != branch.reply:
                continue
            added = renderer.continuation(messages[:k], messages[k], branch.sampled, messages[k + 1:], tools)
            if added is not None:
                return branch.context + added, branch, added
        return renderer.prompt_ids(messages, tools), None, ()

    def text_prompt_for(self, renderer: ChatRenderer, prompt: str | Sequence[int]
                        ) -> tuple[tuple[int, ...], Branch | None, tuple[int, ...]]:
        """``/v1/completions``: a prompt extends a branch when it starts with the branch's text (or, given as
        ids, with its context); only the rest is encoded."""
        for branch in reversed(self.branches):
            if not branch.open or branch.messages is not None:
                continue
            if isinstance(prompt, str) and branch.text is not None and prompt.startswith(branch.text) \
                    and len(prompt) > len(branch.text):
                added = renderer.encode(prompt[len(branch.text):])
                return branch.context + added, branch, added
            ctx = branch.context
            if not isinstance(prompt, str) and len(prompt) > len(ctx) and tuple(prompt[:len(ctx)]) == ctx:
                return tuple(prompt), branch, tuple(prompt[len(ctx):])
        ids = renderer.encode(prompt) if isinstance(prompt, str) else tuple(prompt)
        return ids, None, ()

    def record(self, messages: Sequence[Message] | str | Sequence[int], prompt_ids: tuple[int, ...],
               parent: Branch | None, added: tuple[int, ...], samples: Sequence[Sample],
               replies: Sequence[ParsedTurn]) -> None:
        """A served call (``messages``: the chat messages, or the completion prompt): each choice becomes a
        branch (the continued one's, extended)."""
        c = self.counters
        if parent is None and self.calls:
            c.splits += 1
        c.calls += 1
        c.extensions += parent is not None
        c.prompt_tokens += len(added) if parent is not None else len(prompt_ids)
        c.sampled_tokens += sum(len(s.token_ids) for s in samples)
        self.calls.append(CallRecord(prompt_ids, tuple(samples), parent is not None))
        chat = not isinstance(messages, str) and bool(messages) and isinstance(messages[0], Mapping)
        norm = [normalise(m) for m in messages] if chat else None  # type: ignore[union-attr]
        if parent is not None:
            parent.open = False
        for sample, reply in zip(samples, replies, strict=True):
            builder = _copy(parent.builder) if parent is not None else TrajectoryBuilder()
            if added:
                builder.add_env(added, "")
            builder.add_turn(sample)
            first = parent.prompt_ids if parent is not None else prompt_ids
            branch = Branch(first, builder, sample.token_ids, sample.finish_reason)
            if chat:
                branch.messages, branch.reply = norm, normalise(assistant_message(reply))
            elif isinstance(messages, str):
                branch.text = messages + reply.content
            self.branches.append(branch)

    def trajectories(self) -> list[tuple[tuple[int, ...], Trajectory]]:
        """(first prompt ids, trajectory) of every branch no call continued, in the order they were made."""
        return [b.trajectory() for b in self.branches if b.open]


def _copy(builder: TrajectoryBuilder) -> TrajectoryBuilder:
    out = TrajectoryBuilder()
    out.token_ids, out.logprobs = list(builder.token_ids), list(builder.logprobs)
    out.loss_mask = list(builder.loss_mask)
    out.spans, out.texts, out.first_version = list(builder.spans), list(builder.texts), builder.first_version
    return out


def assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    """The assistant message a turn is returned as (OpenAI's shape; call ids are given by the endpoint)."""
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    if turn.tool_calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in turn.tool_calls]
    return msg


def normalise(message: Message) -> dict[str, Any]:
    """What decides whether two messages are the same turn: role, text content, name, tool-call id, and calls
    by name and decoded arguments (agents echo replies back with fields added or call ids kept or not)."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: the text ones, joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    out: dict[str, Any] = {"role": message.get("role"), "content": content or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c.get("function", {}).get("name"), _decoded(c.get("function", {}).get("arguments")))
                             for c in calls if isinstance(c, Mapping)]
    return out


def _decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
