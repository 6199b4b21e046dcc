"""The rollout queue's wire format: exact JSON round trips, and bad fields refused naming their path; and the
ingest server's and client's configs (no server here)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from asyncrl.config import ConfigError
from asyncrl.queues.ingest_client import RemoteQueueClient
from asyncrl.queues.ingest_server import IngestServerConfig
from asyncrl.queues.wire import WireError, group_from_json, group_to_json
from asyncrl.types import FinishReason, Rollout, Sample, VersionSpan
from tests.support.remote_queue import TOKEN, _sample0, make_group

pytestmark = [pytest.mark.timeout(15), pytest.mark.filterwarnings("error")]


def test_wire_round_trip_is_exact_through_json_text() -> None:
    group = make_group(tokens=5)
    back = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert back == group
    assert group_to_json(group)["v"] == 3
    s = back.rollouts[1].sample
    assert type(back.rollouts) is tuple and type(s.token_ids) is tuple and type(s.version_spans) is tuple
    assert type(back.prompt.token_ids) is tuple and s.finish_reason is FinishReason.LENGTH
    assert s.version_spans == (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5))
    assert back.staleness(5) == group.staleness(5) == 2 and back.newest_version == 4


def test_wire_carries_the_prompt_ids_once_per_group_and_no_arrival_time() -> None:
    obj = group_to_json(make_group(n=3))
    assert set(obj) == {"v", "group_id", "meta", "prompt", "rollouts"}
    assert obj["prompt"]["token_ids"] == [1, 2, 3]
    assert all(set(r) == {"sample", "reward"} and "prompt_ids" not in r["sample"] for r in obj["rollouts"])


def test_wire_carries_an_empty_completion_with_its_submit_version() -> None:
    empty = Sample((), (), FinishReason.ABORT, (VersionSpan(5, 0, 0),))
    group = replace(make_group(), rollouts=(Rollout(empty, 0.0),))
    assert group_from_json(json.loads(json.dumps(group_to_json(group)))) == group


def _empty(obj: dict[str, Any], spans: list[dict[str, int]]) -> None:
    _sample0(obj).update(token_ids=[], logprobs=[], version_spans=spans)


WIRE_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("str token id", lambda o: _sample0(o)["token_ids"].__setitem__(1, "11"),
     "rollouts[0].sample.token_ids[1]: must be an integer >= 0"),
    ("bool token id", lambda o: o["prompt"]["token_ids"].__setitem__(0, True),
     "prompt.token_ids[0]: must be an integer"),
    ("NaN logprob", lambda o: _sample0(o)["logprobs"].__setitem__(2, math.nan),
     "rollouts[0].sample.logprobs[2]: must be a finite number, got nan"),
    ("inf reward", lambda o: o["rollouts"][0].__setitem__("reward", math.inf), "rollouts[0].reward: must be a finite"),
    ("length mismatch", lambda o: o["rollouts"][1]["sample"]["logprobs"].pop(),
     "rollouts[1].sample.logprobs: length 3 != token_ids length 4"),
    ("unknown finish", lambda o: _sample0(o).__setitem__("finish_reason", "eos"),
     "rollouts[0].sample.finish_reason: must be"),
    ("spans short", lambda o: _sample0(o)["version_spans"].pop(),
     "rollouts[0].sample.version_spans: cover 2 tokens but token_ids has 4"),
    ("span gap", lambda o: _sample0(o)["version_spans"][1].__setitem__("start", 3),
     "rollouts[0].sample.version_spans[1].start: 3 != 2"),
    ("empty span among tokens",
     lambda o: _sample0(o)["version_spans"].insert(1, {"version": 3, "start": 2, "end": 2}),
     "rollouts[0].sample.version_spans[1].end: 2 <= start 2"),
    ("negative version", lambda o: _sample0(o)["version_spans"][0].__setitem__("version", -1),
     "rollouts[0].sample.version_spans[0].version: must be an integer >= 0"),
    ("version goes back", lambda o: _sample0(o)["version_spans"][1].__setitem__("version", 2),
     "rollouts[0].sample.version_spans[1].version: 2 < previous span's 3"),
    ("empty completion, no span", lambda o: _empty(o, []),
     "rollouts[0].sample.version_spans: an empty completion carries exactly one empty span, got 0"),
    ("empty completion, two spans",
     lambda o: _empty(o, [{"version": 3, "start": 0, "end": 0}, {"version": 4, "start": 0, "end": 0}]),
     "rollouts[0].sample.version_spans: an empty completion carries exactly one empty span, got 2"),
    ("empty completion, span not empty", lambda o: _empty(o, [{"version": 3, "start": 0, "end": 1}]),
     "rollouts[0].sample.version_spans[0].end: must be 0"),
    ("v1 rollout field", lambda o: o["rollouts"][0].__setitem__("group_id", "g0"),
     "rollouts[0].group_id: unknown field"),
    ("v1 group field", lambda o: o.__setitem__("created_at", 12.5), "created_at: unknown field"),
    ("unknown field", lambda o: o.__setitem__("extra", 1), "extra: unknown field"),
    ("missing field", lambda o: o["prompt"].pop("text"), "prompt.text: missing"),
    ("missing sample field", lambda o: _sample0(o).pop("text"), "rollouts[0].sample.text: missing"),
    ("no rollouts", lambda o: o.__setitem__("rollouts", []), "rollouts: a group needs at least one rollout"),
    ("old version", lambda o: o.__setitem__("v", 2), "v: unsupported wire version 2; this build reads 3"),
    ("future version", lambda o: o.__setitem__("v", 4), "v: unsupported wire version 4"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in WIRE_CASES], ids=[c[0] for c in WIRE_CASES])
def test_wire_rejects_bad_fields_naming_the_path(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    obj = group_to_json(make_group())
    mutate(obj)
    with pytest.raises(WireError, match="^" + re.escape(message)):
        group_from_json(obj)


@pytest.mark.parametrize("answer, path", [((1, 2), "prompt.answer"), ({1, 2}, "prompt.answer"),
                                          ({"k": [math.nan]}, "prompt.answer.k[0]"), ({1: "x"}, "prompt.answer")])
def test_wire_encode_refuses_answers_json_cannot_carry_exactly(answer: Any, path: str) -> None:
    group = replace(make_group(), prompt=replace(make_group().prompt, answer=answer))
    with pytest.raises(WireError) as info:
        group_to_json(group)
    assert info.value.path == path


def test_config_is_validated_and_hides_the_token() -> None:
    cfg = IngestServerConfig(token=TOKEN)
    assert (cfg.host, cfg.port, cfg.max_body_bytes, cfg.put_timeout_s) == ("127.0.0.1", 0, 4 << 20, 5.0)
    assert (cfg.close_grace_s, cfg.active_window_s) == (10.0, 60.0)
    assert TOKEN not in repr(cfg)
    for kwargs, name in [({"token": ""}, "token"), ({"token": "a b"}, "token"), ({"port": 70000}, "port"),
                         ({"put_timeout_s": 0}, "put_timeout_s"), ({"max_body_bytes": 0}, "max_body_bytes"),
                         ({"close_grace_s": -1}, "close_grace_s"), ({"active_window_s": 0}, "active_window_s")]:
        with pytest.raises(ConfigError) as info:
            IngestServerConfig(**{"token": TOKEN, **kwargs})
        assert info.value.field == f"IngestServerConfig.{name}"
    for kwargs, name in [({"token": ""}, "token"), ({"url": "ftp://x"}, "url"), ({"max_retries": -1}, "max_retries"),
                         ({"producer_id": "a\nb"}, "producer_id")]:
        with pytest.raises(ConfigError) as info:
            RemoteQueueClient(**{"url": "http://127.0.0.1:1", "token": TOKEN, **kwargs})
        assert info.value.field == f"RemoteQueueClient.{name}"
    assert TOKEN not in repr(RemoteQueueClient("http://127.0.0.1:1", TOKEN))
