"""Tools for episodes: plain async Python functions, called by name with a timeout, and a ready-made tool-use
environment around them.

``ToolBox`` runs one call: a tool that raises (or a name that is not a tool) is an error the model gets to see,
counted as a tool error; a tool that overruns ``timeout_s`` drops the group (``tool_timeout``), because a hung
tool says nothing about the policy. ``ToolEnv`` is the usual loop: each model turn either calls a tool, whose
result is appended as environment tokens, or gives the final answer, which ends the episode.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.episodes.types import StepResult
from asyncrl.errors import RolloutDropped
from asyncrl.types import DropReason, Sample

Tool = Callable[..., Awaitable[Any]]  # a plain async function; its return value is shown to the model as str()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model wrote: which tool, with which arguments (as parsed from its turn)."""

    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a call gave."""

    call: ToolCall
    ok: bool  # False: the tool raised, or there is no tool of that name
    output: str  # str() of the return value, or the error as "ErrorType: message"


class ToolBox:
    """Named async tools, every call bounded by ``timeout_s`` seconds (keep it below the episode's
    ``env_timeout_s``, which bounds the whole step the call is made in)."""

    def __init__(self, tools: Iterable[Tool] | Mapping[str, Tool], timeout_s: float = 10.0) -> None:
        named = dict(tools) if isinstance(tools, Mapping) else {t.__name__: t for t in tools}
        for name, fn in named.items():
            if not inspect.iscoroutinefunction(fn):
                raise TypeError(f"tool {name!r} must be an async function, got {fn!r}")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"ToolBox timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.tools: dict[str, Tool] = named
        self.timeout_s = timeout_s

    async def call(self, call: ToolCall) -> ToolResult:
        """Run ``call``. Raises ``RolloutDropped(tool_timeout)`` when the tool overruns; any other failure is
        returned as a result with ``ok=False``."""
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolResult(call, False, f"LookupError: no tool named {call.name!r}")
        try:
            async with asyncio.timeout(self.timeout_s) as scope:
                value = await fn(*call.args)
        except TimeoutError as exc:
            if scope.expired():
                raise RolloutDropped(DropReason.TOOL_TIMEOUT, f"tool {call.name!r} took longer than "
                                                              f"{self.timeout_s}s") from None
            return ToolResult(call, False, _error(exc))
        except RolloutDropped:
            raise
        except Exception as exc:  # the model called it badly (or the tool is broken): the model sees why
            return ToolResult(call, False, _error(exc))
        return ToolResult(call, True, str(value))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ToolEnv:
    """A tool-use episode. After each model turn, ``parse(turn)`` finds the tool call in it: a call runs on
    ``tools`` and ``render(result)`` gives the ids to append (and their text); no call means the turn is the final
    answer, and the episode ends with reward ``score(turn)`` (None: 0, leaving the reward to a reward function
    over the whole trajectory)."""

    def __init__(self, tools: ToolBox, parse: Callable[[Sample], ToolCall | None],
                 render: Callable[[ToolResult], tuple[Sequence[int], str]],
                 score: Callable[[Sample], float] | None = None) -> None:
        self.tools = tools
        self.parse = parse
        self.render = render
        self.score = score

    async def step(self, turn: Sample) -> StepResult:
        call = self.parse(turn)
        if call is None:
            return StepResult(reward=self.score(turn) if self.score is not None else 0.0, done=True)
        result = await self.tools.call(call)
        ids, text = self.render(result)
        return StepResult(tuple(ids), text=text, tool_calls=1, tool_errors=0 if result.ok else 1)

    async def close(self) -> None:
        pass  # a ToolEnv holds nothing; tools that do are closed by their owner
