"""Stop strings, matched by the endpoint on the decoded completion (engines stop on ids only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from asyncrl.agents.chat import ChatRenderer
from asyncrl.types import FinishReason, Sample, VersionSpan


def cut_at_stop(sample: Sample, stops: Sequence[str], renderer: ChatRenderer) -> tuple[Sample, str] | None:
    """``sample`` cut after the token that completes the first stop string, and the text before that string;
    None when no stop string occurs. The ids keep the stop string's tokens (what the model sampled, and so its
    context); the text, as OpenAI's, does not."""
    text = renderer.decode(sample.token_ids)
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    at, stop = min(found)
    lo, hi = 1, len(sample.token_ids)  # the fewest ids whose text holds the stop string at ``at``
    while lo < hi:
        mid = (lo + hi) // 2
        if renderer.decode(sample.token_ids[:mid]).find(stop) == at:
            hi = mid
        else:
            lo = mid + 1
    spans = tuple(VersionSpan(v.version, v.start, min(v.end, lo)) for v in sample.version_spans if v.start < lo)
    cut = replace(sample, token_ids=sample.token_ids[:lo], logprobs=sample.logprobs[:lo],
                  finish_reason=FinishReason.STOP, version_spans=spans or sample.version_spans[:1],
                  text=text[:at])
    return cut, text[:at]
