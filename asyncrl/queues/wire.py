"""JSON wire format for ``RolloutGroup`` (used by the rollout ingest server and its client).

Plain JSON only, never pickle: the server reads bytes from the network and must not execute them.
Decoding is strict because a malformed rollout that slips through corrupts the loss silently (a NaN
log-prob, a log-prob list one token short, a span that misses tokens). Every error is a ``WireError``
naming the bad field's path, e.g. ``rollouts[2].sample.logprobs: length 7 != token_ids length 8``.

Layout (``"v": 3``; the prompt, its token ids included, is carried once per group)::

    {"v": 3, "group_id": str, "meta": {str: json},
     "prompt": {"prompt_id": str, "token_ids": [int], "text": str, "answer": json},
     "rollouts": [{"sample": {"token_ids": [int], "logprobs": [float],
                              "finish_reason": "stop"|"length"|"abort",
                              "version_spans": [{"version": int, "start": int, "end": int}],
                              "text": str, "loss_mask": null | [0|1]},
                   "reward": float}],
     "companions": {str: [sample, ...]}}  # optional: samples its maker attached for the loss, by role

Version spans are ordered, each non-empty, versions never going back. With ``"loss_mask": null`` (a
``Sample``, a single completion) they tile the completion, contiguous from token 0 to the last. With a loss mask
(a ``Trajectory``, a multi-turn episode: 1 = a model token, 0 = an environment token) they tile exactly the model
tokens: every span lies inside one run of 1s, and together they cover every 1 and no 0; the log-prob at every 0
is exactly 0.0 (an environment token has none). A sample with no model tokens carries exactly one empty span
``{"version": v, "start": 0, "end": 0}`` (the version it was requested under). The arrival time is the
receiving queue's business, not the wire's. Version 3 added ``loss_mask``; version 2 peers are refused.

``group_from_json(group_to_json(g)) == g`` exactly: tuples come back as tuples, enums as enums. Values that
JSON cannot carry exactly (tuples, sets, non-string keys, NaN) are refused when encoding rather than
changed in transit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, Trajectory, VersionSpan

WIRE_VERSION = 3

_GROUP_KEYS = {"v", "group_id", "meta", "prompt", "rollouts"}
_PROMPT_KEYS = {"prompt_id", "token_ids", "text", "answer"}
_ROLLOUT_KEYS = {"sample", "reward"}
_SAMPLE_KEYS = {"token_ids", "logprobs", "finish_reason", "version_spans", "text", "loss_mask"}
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
    if group.companions:  # optional: a group without them is what every earlier peer sends
        obj["companions"] = {role: [_sample_to_json(s) for s in samples] for role, samples in group.companions.items()}
    group_from_json(obj)  # one validator for both directions: what we emit, a peer accepts
    return obj


def _sample_to_json(s: Sample) -> dict[str, Any]:
    return {
        "token_ids": list(s.token_ids),
        "logprobs": list(s.logprobs),
        "finish_reason": s.finish_reason.value if isinstance(s.finish_reason, FinishReason) else s.finish_reason,
        "version_spans": [{"version": v.version, "start": v.start, "end": v.end} for v in s.version_spans],
        "text": s.text,
        "loss_mask": None if s.loss_mask is None else list(s.loss_mask),
    }


# ---------------------------------------------------------------- decoding


def group_from_json(obj: Any) -> RolloutGroup:
    """Decode and validate one group. Raises ``WireError`` naming the first bad field."""
    _check_version(obj)
    d = _fields(obj, "", _GROUP_KEYS | ({"companions", "opponents"} & obj.keys()))
    group_id = _nonempty_str(d["group_id"], "group_id")
    rollouts = _list(d["rollouts"], "rollouts")
    if not rollouts:
        raise WireError("rollouts", "a group needs at least one rollout")
    return RolloutGroup(
        group_id=group_id,
        prompt=_prompt(d["prompt"], "prompt"),
        rollouts=tuple(_rollout(r, f"rollouts[{i}]") for i, r in enumerate(rollouts)),
        meta=_json_object(d["meta"], "meta"),
        companions=_companions(d),
    )


def _companions(d: dict[str, Any]) -> dict[str, tuple[Sample, ...]]:
    # Peers of the first preference release sent XPO's opponents as a top-level list: read as the same role.
    roles = d.get("companions", {}) if "opponents" not in d else {"opponents": d["opponents"]}
    if not isinstance(roles, dict):
        raise WireError("companions", f"must be an object of role -> [sample], got {_kind(roles)}")
    out = {}
    for role, samples in roles.items():
        path = f"companions.{role}" if "opponents" not in d else "opponents"
        out[role] = tuple(_sample(s, f"{path}[{i}]") for i, s in enumerate(_list(samples, path)))
    return out


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
    finish_reason = _finish_reason(d["finish_reason"], f"{path}.finish_reason")
    text = _str(d["text"], f"{path}.text")
    mask = _loss_mask(d["loss_mask"], f"{path}.loss_mask", len(tokens))
    if mask is None:
        spans = _spans(d["version_spans"], f"{path}.version_spans", len(tokens))
        return Sample(token_ids=tokens, logprobs=logprobs, finish_reason=finish_reason, version_spans=spans, text=text)
    _check_env_logprobs(logprobs, mask, f"{path}.logprobs")
    spans = _masked_spans(d["version_spans"], f"{path}.version_spans", mask)
    return Trajectory(token_ids=tokens, logprobs=logprobs, finish_reason=finish_reason, version_spans=spans,
                      text=text, loss_mask=mask)


def _spans(obj: Any, path: str, num_tokens: int) -> tuple[VersionSpan, ...]:
    """Spans must tile ``[0, num_tokens)`` in order, each non-empty, versions never going back. An empty
    completion carries exactly one empty span ``[v, 0, 0]``: the version it was requested under."""
    items = _list(obj, path)
    if num_tokens == 0:
        return _empty_span(items, path)
    spans: list[VersionSpan] = []
    for i, item in enumerate(items):
        p = f"{path}[{i}]"
        span = _span(item, p, spans)
        expected_start = spans[-1].end if spans else 0
        if span.start != expected_start:
            raise WireError(f"{p}.start", f"{span.start} != {expected_start} (spans must be contiguous from 0)")
        spans.append(span)
    covered = spans[-1].end if spans else 0
    if covered != num_tokens:
        raise WireError(path, f"cover {covered} tokens but token_ids has {num_tokens}")
    return tuple(spans)


def _masked_spans(obj: Any, path: str, mask: tuple[int, ...]) -> tuple[VersionSpan, ...]:
    """Spans of a trajectory must tile its model tokens (the runs of 1s in ``mask``) in order, each inside one
    run; no environment token (0) is covered. No model tokens: exactly one empty span ``[v, 0, 0]``."""
    items = _list(obj, path)
    runs = _runs(mask)
    if not runs:
        return _empty_span(items, path)
    spans: list[VersionSpan] = []
    index = 0
    for run_start, run_end in runs:
        pos = run_start
        while pos < run_end:
            p = f"{path}[{index}]"
            if index >= len(items):
                raise WireError(path, f"model tokens from {pos} on are not covered (loss_mask 1 up to {run_end})")
            span = _span(items[index], p, spans)
            if span.start != pos:
                raise WireError(f"{p}.start", f"{span.start} != {pos} (spans must tile the model tokens, "
                                              f"loss_mask 1 over [{run_start}, {run_end}))")
            if span.end > run_end:
                raise WireError(f"{p}.end", f"{span.end} > {run_end}: the span covers environment tokens")
            spans.append(span)
            pos, index = span.end, index + 1
    if index != len(items):
        raise WireError(f"{path}[{index}]", "covers no model token (every model token is already covered)")
    return tuple(spans)


def _span(item: Any, p: str, before: list[VersionSpan]) -> VersionSpan:
    d = _fields(item, p, _SPAN_KEYS)
    span = VersionSpan(_version(d["version"], f"{p}.version"), _int(d["start"], f"{p}.start"),
                       _int(d["end"], f"{p}.end"))
    if span.end <= span.start:
        raise WireError(f"{p}.end", f"{span.end} <= start {span.start} (spans must be non-empty)")
    if before and span.version < before[-1].version:
        raise WireError(f"{p}.version", f"{span.version} < previous span's {before[-1].version}")
    return span


def _empty_span(items: list[Any], path: str) -> tuple[VersionSpan, ...]:
    if len(items) != 1:
        raise WireError(path, f"an empty completion carries exactly one empty span, got {len(items)} spans")
    d = _fields(items[0], f"{path}[0]", _SPAN_KEYS)
    for key in ("start", "end"):
        if _int(d[key], f"{path}[0].{key}") != 0:
            raise WireError(f"{path}[0].{key}", "must be 0 in the empty span of an empty completion")
    return (VersionSpan(_version(d["version"], f"{path}[0].version"), 0, 0),)


def _runs(mask: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of 1s."""
    runs: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (not runs or runs[-1][1] != i):
            runs.append((i, i + 1))
        elif m:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


def _loss_mask(x: Any, path: str, num_tokens: int) -> tuple[int, ...] | None:
    if x is None:
        return None
    items = _list(x, path)
    if len(items) != num_tokens:
        raise WireError(path, f"length {len(items)} != token_ids length {num_tokens}")
    for i, m in enumerate(items):
        if type(m) is not int or m not in (0, 1):  # ``type``: a bool would pass ``in (0, 1)``
            raise WireError(f"{path}[{i}]", f"must be 0 or 1, got {m!r}")
    return tuple(items)


def _check_env_logprobs(logprobs: tuple[float, ...], mask: tuple[int, ...], path: str) -> None:
    # Exactly 0.0: a value there would be a log-prob shifted onto the wrong token, or one no model produced.
    for i, (lp, m) in enumerate(zip(logprobs, mask)):
        if not m and lp != 0.0:
            raise WireError(f"{path}[{i}]", f"{lp} at an environment token (loss_mask 0); must be 0.0")


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
