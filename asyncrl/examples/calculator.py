"""The task and tool of ``asyncrl/examples/tool_use.py``: ``a*b=`` problems, the calculator (a plain async function),
and the protocol between model and environment (a call is ``<calc>a*b</calc>`` ending the model's turn; the
result comes back as ``<res>product</res>`` environment tokens; tool markers are single tokens)."""

from __future__ import annotations

import random
import re
from typing import Any

from asyncrl.testing.tasks import arithmetic
from asyncrl.examples import common

CALL, END_CALL, RES, END_RES, ERR = "<calc>", "</calc>", "<res>", "</res>", "<err>"
TOOL_TOKENS = (CALL, END_CALL, RES, END_RES, ERR)
_CALL = re.compile(rf"{re.escape(CALL)}(.*){re.escape(END_CALL)}\s*$", re.S)
_EXPRESSION = re.compile(r"(\d{1,6})([*+-])(\d{1,6})")


def multiplication_task(n_train: int = 7000, n_held_out: int = 200, seed: int = 0) -> common.Task:
    """``a*b=`` with a, b in 10..99; held-out problems are disjoint from training ones."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    examples = [common.Example(f"{a}*{b}=", str(a * b)) for a, b in pairs[: n_train + n_held_out]]
    return common.Task("multiplication", examples[n_held_out:], examples[:n_held_out], arithmetic.reward)


async def calc(expression: str) -> int:
    """The calculator tool: ``a*b``, ``a+b`` or ``a-b`` on non-negative integers (no eval of model text)."""
    match = _EXPRESSION.fullmatch(expression.strip())
    if match is None:
        raise ValueError(f"cannot evaluate {expression!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    return a * b if op == "*" else a + b if op == "+" else a - b


class CalculatorProtocol:
    """How the model and the environment talk: the call format, and the result as environment tokens."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.end_call = tok.convert_tokens_to_ids(END_CALL)  # the stop token of a calling turn

    def parse(self, turn: Any) -> Any:
        from asyncrl.episodes import ToolCall

        match = _CALL.search(turn.text) if turn.token_ids and turn.token_ids[-1] == self.end_call else None
        return ToolCall("calc", (match[1],)) if match else None

    def render(self, result: Any) -> tuple[list[int], str]:
        text = f"{RES}{result.output}{END_RES}" if result.ok else ERR
        return self.tok(text, add_special_tokens=False).input_ids, text

    def env_factory(self, reward: Any, timeout_s: float = 5.0) -> Any:
        """One ``ToolEnv`` per episode, rewarding an exact final answer with 1.0."""
        from asyncrl.episodes import ToolBox, ToolEnv

        tools = ToolBox([calc], timeout_s=timeout_s)
        return lambda prompt: ToolEnv(tools, self.parse, self.render,
                                      score=lambda turn: reward(turn.text, prompt.answer))


# -- the same protocol as a chat: what the OpenAI-endpoint example (openai_agent.py) serves ---------------------

# Renders a conversation exactly as the episodes above are laid out: the user's problem, a call as
# <calc>expression</calc> (after any text the model wrote before it), its result as <res>value</res>, a final
# answer ended by the end-of-sequence token.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}{{ m.content or '' }}{%- for c in m.tool_calls -%}"
    "<calc>{{ c.function.arguments.expression }}</calc>{%- endfor -%}"
    "{%- else -%}{{ m.content }}{{ eos_token }}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<res>{{ m.content }}</res>"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{%- endfor -%}")


class CalcToolParser:
    """A turn ending in ``<calc>expression</calc>`` is a call of ``calc`` with ``{"expression": ...}``; the
    ``</calc>`` token ends such a turn (a ``ToolCallParser`` of ``asyncrl.agents``)."""

    stop_tokens = (END_CALL,)

    def parse(self, text: str) -> Any:
        import json

        from asyncrl.agents import ParsedTurn, ToolCall

        match = _CALL.search(text)
        if match is None:
            return ParsedTurn(text)
        return ParsedTurn(text[:match.start()], (ToolCall("calc", json.dumps({"expression": match[1]})),))
