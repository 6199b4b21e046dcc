"""What every vLLM-backed engine does the same way: the prompt-room check, finish reasons, version spans, and
restoring the last good weights after a failed reload."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from asyncrl.aio import settle
from asyncrl.errors import EngineError, PromptRejected
from asyncrl.types import FinishReason, VersionSpan

log = logging.getLogger(__name__)

RESTORE_ATTEMPTS = 3  # full reloads of the last good weights after a failed update
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def completion_room(prompt_ids: tuple[int, ...], max_model_len: int, max_tokens: int) -> int:
    """How many tokens may be generated after ``prompt_ids``: ``max_tokens``, capped by the context.
    Raises ``PromptRejected`` for an empty prompt or one that leaves no room."""
    if not prompt_ids:
        raise PromptRejected("empty prompt")
    room = max_model_len - len(prompt_ids)
    if room <= 0:
        raise PromptRejected(f"prompt of {len(prompt_ids)} tokens leaves no room in a context of {max_model_len}")
    return min(max_tokens, room)


def finish_reason(engine: str, reason: str | None) -> FinishReason:
    """vLLM's finish reason as ours. Anything else (an engine-side ``error``, a newer vLLM's reason) is an
    ``EngineError``: guessing would put a broken sample into the loss."""
    try:
        return _FINISH_REASONS[reason]  # type: ignore[index]
    except KeyError:
        raise EngineError(engine, f"unexpected finish reason {reason!r}") from None


class SpanBuilder:
    """Version spans of one completion, built from the tokens as they arrive (where the engine does not stamp
    versions itself)."""

    __slots__ = ("spans", "tokens")

    def __init__(self) -> None:
        self.spans: list[VersionSpan] = []
        self.tokens = 0

    def add(self, version: int, count: int) -> None:
        """``count`` more tokens, sampled under ``version``."""
        if count <= 0:
            return
        start, end = self.tokens, self.tokens + count
        last = self.spans[-1] if self.spans else None
        if last is not None and last.version == version and last.end == start:
            self.spans[-1] = VersionSpan(version, last.start, end)
        else:
            self.spans.append(VersionSpan(version, start, end))
        self.tokens = end

    def build(self, version_if_empty: int) -> tuple[VersionSpan, ...]:
        return tuple(self.spans) if self.spans else (VersionSpan(version_if_empty, 0, 0),)


def stamped_spans(spans: list[tuple[int, int, int]], version_if_empty: int) -> tuple[VersionSpan, ...]:
    """Spans an engine stamped itself, as ``(version, start, end)``; empty ones dropped."""
    out = tuple(VersionSpan(v, s, e) for v, s, e in spans if e > s)
    return out or (VersionSpan(version_if_empty, 0, 0),)


async def restore_good_weights(engine: str, reload: Callable[[Path], Awaitable[None]], good: Path,
                               failure: BaseException) -> None:
    """After a reload that failed part-way (some layers new, some old), reload the last good weights in full.

    Tried ``RESTORE_ATTEMPTS`` times: a failed load can leave per-layer loading state behind that spoils the
    next reload once. Each attempt runs to its end even if the caller is cancelled. If every attempt fails the
    engine's weights are undefined: ``EngineError``."""
    log.error("weight reload failed on %s (%r); restoring %s", engine, failure, good)
    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        try:
            await settle(reload(good), f"restoring {good} on {engine}")
            return
        except Exception as exc:
            if attempt == RESTORE_ATTEMPTS:
                raise EngineError(engine, f"weight reload failed and restoring the previous weights failed too "
                                          f"({exc!r}); the engine's weights are undefined") from failure
            log.warning("restore attempt %d of %d on %s failed (%r); retrying", attempt, RESTORE_ATTEMPTS, engine, exc)
