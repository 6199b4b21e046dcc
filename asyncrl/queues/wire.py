"""JSON wire format for ``RolloutGroup`` (used by the rollout ingest server and its client).

Plain JSON only, never pickle: the server reads bytes from the network and must not execute them.
Decoding is strict because a malformed rollout that slips through corrupts the loss silently (a NaN
log-prob, a log-prob list one token short, a span that misses tokens). Every error is a ``WireError``
naming the bad field's path, e.g. ``rollouts[2].sample.logprobs: length 7 != token_ids length 8``.

Layout (``"v": 2``; the prompt, its token ids included, is carried once per group)::

    {"v": 2, "group_id": str, "meta": {str: json},
     "prompt": {"prompt_id": str, "token_ids": [int], "text": str, "answer": json},
     "rollouts": [{"sample": {"token_ids": [int], "logprobs": [float],
                              "finish_reason": "stop"|"length"|"abort",
                              "version_spans": [{"version": int, "start": int, "end": int}],
                              "text": str},
                   "reward": float}]}

Version spans tile the completion: contiguous from token 0 to the last, each non-empty, versions never
going back; a completion with no tokens carries exactly one empty span ``{"version": v, "start": 0, "end": 0}``
(the version it was requested under). The arrival time is the receiving queue's business, not the wire's.

``group_from_json(group_to_json(g)) == g`` exactly: tuples come back as tuples, enums as enums. Values that
JSON cannot carry exactly (tuples, sets, non-string keys, NaN) are refused when encoding rather than
changed in transit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan

WIRE_VERSION = 2

_GROUP_KEYS = {"v", "group_id", "meta", "prompt", "rollouts"}
_PROMPT_KEYS = {"prompt_id", "token_ids", "text", "answer"}
_ROLLOUT_KEYS = {"sample", "reward"}
_SAMPLE_KEYS = {"token_ids", "logprobs", "finish_reason", "version_spans", "text"}
_SPAN_KEYS = {"version", "start", "end"}
_FINISH_REASONS = {r.value: r for r in FinishReason}


class WireError(ValueError):
    """A wire message is malformed. ``path`` names the bad field (``rollouts[2].reward``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.detail = message

    def within(self, prefix: str) -> WireError:
        """The same error seen from an enclosing message (``groups[1]`` + ``.rollouts[0]...``)."""
        return WireError(f"{prefix}.{self.path}" if self.path else prefix, self.detail)


# ---------------------------------------------------------------- encoding


def group_to_json(group: RolloutGroup) -> dict[str, Any]:
    """Encode a group as JSON-ready data. Raises ``WireError`` for anything a peer would refuse, so a
    bad group fails in the producer that made it rather than as a 400 from the server."""
    obj = {
        "v": WIRE_VERSION,
        "group_id": group.group_id,
        "meta": group.meta if isinstance(group.meta, dict) else dict(group.meta),
        "prompt": {"prompt_id": group.prompt.prompt_id, "token_ids": list(group.prompt.token_ids),
                   "text": group.prompt.text, "answer": group.prompt.answer},
        "rollouts": [{"sample": _sample_to_json(r.sample), "reward": r.reward} for r in group.rollouts],
    }
    group_from_json(obj)  # one validator for both directions: what we emit, a peer accepts
    return obj


def _sample_to_json(s: Sample) -> dict[str, Any]:
    return {
        "token_ids": list(s.token_ids),
        "logprobs": list(s.logprobs),
        "finish_reason": s.finish_reason.value if isinstance(s.finish_reason, FinishReason) else s.finish_reason,
        "version_spans": [{"version": v.version, "start": v.start, "end": v.end} for v in s.version_spans],
        "text": s.text,
    }


# ---------------------------------------------------------------- decoding


def group_from_json(obj: Any) -> RolloutGroup:
    """Decode and validate one group. Raises ``WireError`` naming the first bad field."""
    _check_version(obj)
    d = _fields(obj, "", _GROUP_KEYS)
    group_id = _nonempty_str(d["group_id"], "group_id")
    rollouts = _list(d["rollouts"], "rollouts")
    if not rollouts:
        raise WireError("rollouts", "a group needs at least one rollout")
    return RolloutGroup(
        group_id=group_id,
        prompt=_prompt(d["prompt"], "prompt"),
        rollouts=tuple(_rollout(r, f"rollouts[{i}]") for i, r in enumerate(rollouts)),
        meta=_json_object(d["meta"], "meta"),
    )


def _check_version(obj: Any) -> None:
    # Checked before the key set, so a peer of another version gets "unsupported version", not "unknown field".
    if not isinstance(obj, dict):
        raise WireError("", f"a group must be a JSON object, got {_kind(obj)}")
    if "v" not in obj:
        raise WireError("v", "missing (wire format version)")
    if obj["v"] != WIRE_VERSION or type(obj["v"]) is not int:
        raise WireError("v", f"unsupported wire version {obj['v']!r}; this build reads {WIRE_VERSION}")


def _prompt(obj: Any, path: str) -> Prompt:
    d = _fields(obj, path, _PROMPT_KEYS)
    return Prompt(
        prompt_id=_str(d["prompt_id"], f"{path}.prompt_id"),
        token_ids=_token_ids(d["token_ids"], f"{path}.token_ids"),
        text=_str(d["text"], f"{path}.text"),
        answer=_json_value(d["answer"], f"{path}.answer"),
    )


def _rollout(obj: Any, path: str) -> Rollout:
    d = _fields(obj, path, _ROLLOUT_KEYS)
    return Rollout(sample=_sample(d["sample"], f"{path}.sample"), reward=_finite(d["reward"], f"{path}.reward"))


def _sample(obj: Any, path: str) -> Sample:
    d = _fields(obj, path, _SAMPLE_KEYS)
    tokens = _token_ids(d["token_ids"], f"{path}.token_ids")
    logprobs = _floats(d["logprobs"], f"{path}.logprobs")
    if len(logprobs) != len(tokens):
        raise WireError(f"{path}.logprobs", f"length {len(logprobs)} != token_ids length {len(tokens)}")
    return Sample(
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=_finish_reason(d["finish_reason"], f"{path}.finish_reason"),
        version_spans=_spans(d["version_spans"], f"{path}.version_spans", len(tokens)),
        text=_str(d["text"], f"{path}.text"),
    )


def _spans(obj: Any, path: str, num_tokens: int) -> tuple[VersionSpan, ...]:
    """Spans must tile ``[0, num_tokens)`` in order, each non-empty, versions never going back. An empty
    completion carries exactly one empty span ``[v, 0, 0]``: the version it was requested under."""
    items = _list(obj, path)
    if num_tokens == 0:
        if len(items) != 1:
            raise WireError(path, f"an empty completion carries exactly one empty span, got {len(items)} spans")
        d = _fields(items[0], f"{path}[0]", _SPAN_KEYS)
        for key in ("start", "end"):
            if _int(d[key], f"{path}[0].{key}") != 0:
                raise WireError(f"{path}[0].{key}", "must be 0 in the empty span of an empty completion")
        return (VersionSpan(_version(d["version"], f"{path}[0].version"), 0, 0),)
    spans: list[VersionSpan] = []
    for i, item in enumerate(items):
        p = f"{path}[{i}]"
        d = _fields(item, p, _SPAN_KEYS)
        span = VersionSpan(_version(d["version"], f"{p}.version"), _int(d["start"], f"{p}.start"),
                           _int(d["end"], f"{p}.end"))
        expected_start = spans[-1].end if spans else 0
        if span.start != expected_start:
            raise WireError(f"{p}.start", f"{span.start} != {expected_start} (spans must be contiguous from 0)")
        if span.end <= span.start:
            raise WireError(f"{p}.end", f"{span.end} <= start {span.start} (spans must be non-empty)")
        if spans and span.version < spans[-1].version:
            raise WireError(f"{p}.version", f"{span.version} < previous span's {spans[-1].version}")
        spans.append(span)
    covered = spans[-1].end if spans else 0
    if covered != num_tokens:
        raise WireError(path, f"cover {covered} tokens but token_ids has {num_tokens}")
    return tuple(spans)


# ---------------------------------------------------------------- field checks


def _fields(obj: Any, path: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireError(path, f"must be a JSON object, got {_kind(obj)}")
    missing, unknown = keys - obj.keys(), obj.keys() - keys
    where = f"{path}." if path else ""
    if missing:
        raise WireError(f"{where}{min(missing)}", "missing")
    if unknown:
        raise WireError(f"{where}{min(map(str, unknown))}", "unknown field")
    return obj


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _str(x: Any, path: str) -> str:
    if type(x) is not str:
        raise WireError(path, f"must be a string, got {_kind(x)}")
    return x


def _nonempty_str(x: Any, path: str) -> str:
    if not _str(x, path):
        raise WireError(path, "must be a non-empty string")
    return x


def _int(x: Any, path: str) -> int:
    if type(x) is not int or x < 0:  # ``type`` check: bool is an int subclass but never a token id
        raise WireError(path, f"must be an integer >= 0, got {x!r}")
    return x


_version = _int  # weight versions start at 0; -1 ("no tokens") would make staleness meaningless


def _finite(x: Any, path: str) -> float:
    if type(x) not in (int, float) or not math.isfinite(x):
        raise WireError(path, f"must be a finite number, got {x!r}")
    return float(x)


def _list(x: Any, path: str) -> list[Any]:
    if not isinstance(x, list):
        raise WireError(path, f"must be a JSON array, got {_kind(x)}")
    return x


def _each(x: Any, path: str, check: Callable[[Any, str], Any]) -> tuple[Any, ...]:
    return tuple(check(v, f"{path}[{i}]") for i, v in enumerate(_list(x, path)))


def _token_ids(x: Any, path: str) -> tuple[int, ...]:
    items = _list(x, path)
    if all(type(t) is int and t >= 0 for t in items):  # fast path: long lists, usually clean
        return tuple(items)
    return _each(items, path, _int)


def _floats(x: Any, path: str) -> tuple[float, ...]:
    items = _list(x, path)
    if all(type(v) is float and math.isfinite(v) for v in items):
        return tuple(items)
    return _each(items, path, _finite)


def _finish_reason(x: Any, path: str) -> FinishReason:
    if isinstance(x, str) and x in _FINISH_REASONS:
        return _FINISH_REASONS[x]
    raise WireError(path, f"must be one of {sorted(_FINISH_REASONS)}, got {x!r}")


def _json_object(x: Any, path: str) -> dict[str, Any]:
    if type(x) is not dict:
        raise WireError(path, f"must be a JSON object, got {_kind(x)}")
    return _json_value(x, path)


def _json_value(x: Any, path: str) -> Any:
    """A copy of ``x`` if JSON carries it exactly (str, finite number, bool, null, list, str-keyed dict)."""
    if x is None or type(x) in (str, bool, int):
        return x
    if type(x) is float:
        return _finite(x, path)
    if type(x) is list:
        return [_json_value(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if type(x) is dict:
        for k in x:
            if type(k) is not str:
                raise WireError(path, f"key {k!r} is not a string (JSON keys are strings)")
        return {k: _json_value(v, f"{path}.{k}") for k, v in x.items()}
    hint = " (use a list; a tuple would come back as a list)" if isinstance(x, tuple) else ""
    raise WireError(path, f"{type(x).__name__} is not JSON-serialisable{hint}")
