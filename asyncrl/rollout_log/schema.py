"""The rollout log's format: one Arrow record batch per trained step, one row per rollout, in the wire's words.

A row holds one rollout of one group of the step's batch, with the group's fields repeated on each of its rows, so
a table of the log reads in pandas as it is. Field names are those of the JSON wire format
(``asyncrl.queues.wire``), and a group read back is decoded through it, with its checks:

==================  ==========================  ======================================================================
column              type                        meaning
==================  ==========================  ======================================================================
step                int64                       the learner step this batch made (1-based: steps taken after it)
policy_version      int64                       the weight version trained (staleness is measured from it)
position            int32                       the group's place in the batch: the order the queue handed groups out
group_id            string                      ``RolloutGroup.group_id``
prompt_id           string                      ``Prompt.prompt_id``
prompt_token_ids    list<int32>                 ``Prompt.token_ids``
prompt_text         string                      ``Prompt.text``
prompt_answer       string                      ``Prompt.answer`` as JSON (not JSON-able: its ``repr`` as a string)
meta                string                      ``RolloutGroup.meta`` as JSON
companions          string (null: none)         ``RolloutGroup.companions`` as the wire's JSON
rollout             int32                       the rollout's index in its group
token_ids           list<int32>                 ``Sample.token_ids``
logprobs            list<float64>               behaviour log-probs, exactly as sampled (nats)
loss_mask           list<int8> (null: plain)    ``Sample.loss_mask`` of a multi-turn trajectory
version_spans       list<struct<version, start, end>>  ``Sample.version_spans``
finish_reason       string                      ``FinishReason`` value
text                string                      ``Sample.text``
reward              float64                     ``Rollout.reward``
staleness           int32                       ``policy_version`` minus the group's oldest version
==================  ==========================  ======================================================================

Each batch carries the step's JSON under the custom metadata key ``asyncrl.step``: ``step``, ``policy_version``,
``served_version``, ``time`` (Unix seconds), ``drops`` (groups dropped since the previous step, by reason, from
the pipeline's books), ``dropped`` (``[group_id, reason]`` of those the queue dropped, the ones the learner's side
sees) and ``metrics`` (the step's ``loss/*``, ``train/*`` and ``rollout/*`` gauges). Each file's schema carries the
run's header (``HEADER_KEY``): ``format``, and what a replay needs to rebuild the learner (``learner``: the
``LearnerConfig``; ``loss``: the GRPO loss's config, sampling and pad id, or null for a loss of the caller's;
``model_dir``; ``dtype``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from asyncrl.queues.wire import WIRE_VERSION, group_from_json, group_to_json
from asyncrl.types import DropReason, RolloutGroup

FORMAT = 1
HEADER_KEY = b"asyncrl.rollout_log"
STEP_KEY = b"asyncrl.step"

_SPAN = pa.struct([("version", pa.int64()), ("start", pa.int32()), ("end", pa.int32())])
SCHEMA = pa.schema([
    ("step", pa.int64()), ("policy_version", pa.int64()), ("position", pa.int32()), ("group_id", pa.string()),
    ("prompt_id", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())), ("prompt_text", pa.string()),
    ("prompt_answer", pa.string()), ("meta", pa.string()), ("companions", pa.string()), ("rollout", pa.int32()),
    ("token_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float64())), ("loss_mask", pa.list_(pa.int8())),
    ("version_spans", pa.list_(_SPAN)), ("finish_reason", pa.string()), ("text", pa.string()),
    ("reward", pa.float64()), ("staleness", pa.int32()),
])


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One trained step as the log holds it (what ``asyncrl.rollout_log.read`` yields)."""

    step: int  # the learner step this batch made (1-based)
    policy_version: int  # the weight version trained
    served_version: int  # the version the engines served then
    groups: tuple[RolloutGroup, ...]  # the batch, in the order trained
    drops: Mapping[DropReason, int]  # groups dropped anywhere since the previous step, by reason
    dropped: tuple[tuple[str, DropReason], ...]  # (group id, reason) of the groups the queue dropped meanwhile
    metrics: Mapping[str, float]  # the step's gauges as the learner reported them
    time: float  # Unix time it was recorded, seconds


def schema_with(header: Mapping[str, Any]) -> pa.Schema:
    """The log's schema carrying the run's header."""
    return SCHEMA.with_metadata({HEADER_KEY: json.dumps({"format": FORMAT, **header}).encode()})


def header_of(schema: pa.Schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(HEADER_KEY)
    if raw is None:
        raise ValueError("not an asyncrl rollout log file (its schema has no header)")
    header: dict[str, Any] = json.loads(raw)
    if header.get("format") != FORMAT:
        raise ValueError(f"rollout log format {header.get('format')!r}; this build reads format {FORMAT}")
    return header


def to_batch(record: StepRecord) -> tuple[pa.RecordBatch, bytes]:
    """A step as a record batch and its custom metadata."""
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for position, group in enumerate(record.groups):
        _group_rows(cols, record.step, record.policy_version, position, group)
    batch = pa.RecordBatch.from_pydict(cols, schema=SCHEMA)
    meta = {"step": record.step, "policy_version": record.policy_version, "served_version": record.served_version,
            "time": record.time, "drops": {r.value: n for r, n in record.drops.items()},
            "dropped": [[gid, r.value] for gid, r in record.dropped],
            "metrics": {k: float(v) for k, v in record.metrics.items() if math.isfinite(float(v))}}
    return batch, json.dumps(meta).encode()


def _group_rows(cols: dict[str, list[Any]], step: int, policy_version: int, position: int,
                group: RolloutGroup) -> None:
    prompt = group.prompt
    shared = {"step": step, "policy_version": policy_version, "position": position, "group_id": group.group_id,
              "prompt_id": prompt.prompt_id, "prompt_token_ids": prompt.token_ids, "prompt_text": prompt.text,
              "prompt_answer": _json(prompt.answer), "meta": json.dumps(dict(group.meta)),
              "companions": json.dumps(group_to_json(group)["companions"]) if group.companions else None,
              "staleness": group.staleness(policy_version)}
    for i, r in enumerate(group.rollouts):
        s = r.sample
        row = {"rollout": i, "token_ids": s.token_ids, "logprobs": s.logprobs, "loss_mask": s.loss_mask,
               "version_spans": [{"version": v.version, "start": v.start, "end": v.end} for v in s.version_spans],
               "finish_reason": s.finish_reason.value, "text": s.text, "reward": r.reward}
        for name, value in (shared | row).items():
            cols[name].append(value)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(repr(value))


def from_batch(batch: pa.RecordBatch, meta: Mapping[bytes, bytes] | None) -> StepRecord:
    """A record batch of the log back as the step it records; a ``WireError`` names a malformed field."""
    info = json.loads((meta or {})[STEP_KEY])
    rows = batch.to_pylist()
    groups: list[RolloutGroup] = []
    start = 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end]["position"] != rows[start]["position"]:
            groups.append(_group(rows[start:end]))
            start = end
    return StepRecord(step=info["step"], policy_version=info["policy_version"],
                      served_version=info["served_version"], groups=tuple(groups),
                      drops={DropReason(r): n for r, n in info["drops"].items()},
                      dropped=tuple((gid, DropReason(r)) for gid, r in info["dropped"]),
                      metrics=info["metrics"], time=info["time"])


def _group(rows: Sequence[dict[str, Any]]) -> RolloutGroup:
    first = rows[0]
    obj: dict[str, Any] = {
        "v": WIRE_VERSION, "group_id": first["group_id"], "meta": json.loads(first["meta"]),
        "prompt": {"prompt_id": first["prompt_id"], "token_ids": first["prompt_token_ids"],
                   "text": first["prompt_text"], "answer": json.loads(first["prompt_answer"])},
        "rollouts": [{"sample": {k: r[k] for k in ("token_ids", "logprobs", "finish_reason", "version_spans",
                                                    "text", "loss_mask")}, "reward": r["reward"]} for r in rows],
    }
    if first["companions"] is not None:
        obj["companions"] = json.loads(first["companions"])
    return group_from_json(obj)
