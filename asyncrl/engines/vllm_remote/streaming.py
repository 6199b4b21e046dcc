"""Reading one streamed ``/v1/completions`` response into a ``Sample``."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from asyncrl.engines.common import SpanBuilder, finish_reason
from asyncrl.errors import EngineError
from asyncrl.types import Sample


class SseReader:
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


class SampleBuilder:
    """Accumulates one streamed completion, tagging each chunk with the version current when it arrived."""

    def __init__(self, engine: str, request_id: str, version_at_submit: int) -> None:
        self._engine = engine
        self.request_id = request_id
        self._version_at_submit = version_at_submit
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._text: list[str] = []
        self._spans = SpanBuilder()
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
            self._spans.add(version, len(ids))
            self._token_ids.extend(ids)
            self._logprobs.extend(float(lp) for lp in lps)
            self._text.append(choice.get("text") or "")
            self._finish = choice.get("finish_reason") or self._finish

    def build(self, clean_end: bool) -> Sample:
        if self._finish is None:
            if not (clean_end and not self._token_ids):
                raise EngineError(self._engine, f"request {self.request_id}: stream ended without a finish "
                                                f"reason after {len(self._token_ids)} tokens")
            # The server drops token-less chunks, so a request aborted before its first token ends with
            # [DONE] and nothing else (vLLM 0.26 and 0.32 completions streaming).
            self._finish = "abort"
        return Sample(token_ids=tuple(self._token_ids), logprobs=tuple(self._logprobs),
                      finish_reason=finish_reason(self._engine, self._finish),
                      version_spans=self._spans.build(self._version_at_submit), text="".join(self._text))
