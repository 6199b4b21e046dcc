"""Problems from the files people have: JSONL or Parquet rows, a prompt column and an answer column.

Layouts read without options: ``{"prompt": "...", "answer": "..."}``; verl's parquet (``prompt`` as chat
messages, the answer in ``reward_model.ground_truth``); Hugging Face GSM8K (``question`` / ``answer``, the answer
a solution ending in ``#### 72``). Anything else by naming its columns, dotted for nested fields
(``prompt_key="input.text"``, ``answer_key="meta.label"``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.data.rewards import reference_answer

PROMPT_KEYS = ("prompt", "question")  # tried in this order when no prompt_key is given
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "extra_info.answer")  # likewise for answer_key
_MISSING = object()


@dataclass(frozen=True, slots=True)
class Example:
    """One problem: the prompt (text, or chat messages ``[{"role", "content"}]``) and its reference answer."""

    prompt: str | list[dict[str, str]]
    answer: str


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` file (one JSON object a line), a ``.json`` file (an array of objects, or one
    object a line) or a ``.parquet`` file, as dictionaries (nested columns as nested dictionaries)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unknown format {path.suffix!r}; asyncrl reads .jsonl, .json and .parquet")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number} is not JSON ({e.msg}): {line[:80]!r}") from None
    return rows


def load_examples(path_or_rows: str | Path | Sequence[dict[str, Any]], prompt_key: str | None = None,
                  answer_key: str | None = None) -> list[Example]:
    """Examples from a file (``load_rows``) or from rows already read.

    ``prompt_key`` / ``answer_key`` name the columns, dotted for nested fields (``reward_model.ground_truth``);
    left out, the first present of ``PROMPT_KEYS`` / ``ANSWER_KEYS`` is used. A prompt is a string or chat
    messages; an answer a string or a number. A GSM8K answer keeps only its reference, the text after the last
    ``####``. A row without them is an error naming the source, the row (counting from 0), the key and the
    row's keys.
    """
    source = str(path_or_rows) if isinstance(path_or_rows, str | Path) else "rows"
    rows = load_rows(path_or_rows) if isinstance(path_or_rows, str | Path) else path_or_rows
    examples = [_example(row, f"{source}: row {i}", prompt_key, answer_key) for i, row in enumerate(rows)]
    if not examples:
        raise ValueError(f"{source}: no rows")
    return examples


def split_held_out(examples: Sequence[Example], n_held_out: int, seed: int = 0) -> tuple[list[Example],
                                                                                          list[Example]]:
    """``(train, held_out)`` after a seeded shuffle. The held-out set is ``min(n_held_out, len // 5)`` examples,
    at least 1 (0 if ``n_held_out`` is 0), so most data stays for training; with a single example it is also
    the training set."""
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    k = max(1, min(n_held_out, len(shuffled) // 5)) if n_held_out > 0 else 0
    return shuffled[k:] or shuffled, shuffled[:k]


def _example(row: Any, where: str, prompt_key: str | None, answer_key: str | None) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, not an object with named fields")
    prompt_at, prompt = _lookup(row, where, "prompt", (prompt_key,) if prompt_key else PROMPT_KEYS)
    answer_at, answer = _lookup(row, where, "answer", (answer_key,) if answer_key else ANSWER_KEYS)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: {answer_at!r} must be a string or a number, not {type(answer).__name__} "
                         f"({answer!r:.80})")
    return Example(_prompt(prompt, where, prompt_at), reference_answer(str(answer)))


def _lookup(row: dict[str, Any], where: str, what: str, keys: Sequence[str]) -> tuple[str, Any]:
    for key in keys:
        value = _get(row, key)
        if value is not _MISSING and value is not None:
            return key, value
    tried = " or ".join(repr(k) for k in keys)
    flag = "--prompt-key / prompt_key" if what == "prompt" else "--answer-key / answer_key"
    raise ValueError(f"{where}: no {what}: found no {tried} (the row's keys: {sorted(_keys(row))}); "
                     f"name the column with {flag}, dotted for a nested field")


def _get(row: dict[str, Any], key: str) -> Any:
    if key in row:  # a column whose name holds dots (a flattened table) wins over a nested path
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _keys(row: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key of ``row``, nested ones dotted, so an error shows the path to write."""
    out = []
    for key, value in row.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += _keys(value, f"{prefix}{key}.")
    return out


def _prompt(value: Any, where: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: {key!r} is empty")
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{where}: {key!r} must be a string or chat messages [{{'role': ..., 'content': ...}}], "
                     f"got {value!r:.120}")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
