"""Problems read from the layouts people have: JSONL with plain prompts, Parquet with chat messages, Hugging Face
GSM8K, verl's parquet, and anything else through named (dotted) columns; errors name the file, the row, the key
and the row's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.data import Example, load_examples, load_rows, split_held_out


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")  # a trailing blank line is skipped
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_with_plain_prompts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": 2}])
    assert load_examples(path) == [Example("3+4=", "7"), Example("1+1=", "2")]  # a number answer becomes text


def test_parquet_with_chat_messages(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": chat, "answer": "7"}])
    assert load_examples(path) == [Example(chat, "7")]


def test_hugging_face_gsm8k_question_and_hash_answer(tmp_path: Path) -> None:
    rows = [{"question": "Tom has 12 apples and buys 7 more. How many?", "answer": "12 + 7 = 19\n#### 19"},
            {"question": "Sam had 1,000 and spent 1.", "answer": "So #### 1,000 - 1 = 999\n#### 999"}]
    path = write_parquet(tmp_path / "gsm8k.parquet", rows)
    expected = [Example(rows[0]["question"], "19"), Example(rows[1]["question"], "999")]  # after the last ####
    assert load_examples(path) == expected  # no prompt column: question is used
    assert load_examples(path, prompt_key="question") == expected


def test_verl_parquet_with_messages_and_reward_model_ground_truth(tmp_path: Path) -> None:
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(3)]
    examples = load_examples(write_parquet(tmp_path / "train.parquet", rows))
    assert examples == [Example([{"role": "user", "content": f"{i}+1="}], str(i + 1)) for i in range(3)]


def test_custom_columns_through_dotted_keys(tmp_path: Path) -> None:
    rows = [{"input": {"text": "2*3="}, "meta": {"label": {"value": 6}}, "answer": "not this"}]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    assert load_examples(path, prompt_key="input.text", answer_key="meta.label.value") == [Example("2*3=", "6")]
    flat = [{"q": "2*3=", "meta.label": "6"}]  # a column named with a dot (a flattened table) is found as it is
    assert load_examples(flat, prompt_key="q", answer_key="meta.label") == [Example("2*3=", "6")]


def test_the_answer_lookup_order_is_answer_then_verl_then_extra_info() -> None:
    row = {"prompt": "x", "reward_model": {"ground_truth": "b"}, "extra_info": {"answer": "c"}}
    assert load_examples([{**row, "answer": "a"}])[0].answer == "a"
    assert load_examples([row])[0].answer == "b"
    assert load_examples([{"prompt": "x", "extra_info": {"answer": "c"}}])[0].answer == "c"


def test_a_missing_key_names_the_file_the_row_the_key_and_the_rows_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"},
                                                {"prompt": "2+2=", "solution": {"final": "4"}}])
    with pytest.raises(ValueError) as err:
        load_examples(path)
    message = str(err.value)
    assert str(path) in message and "row 1" in message and "no answer" in message
    assert "'answer'" in message and "'reward_model.ground_truth'" in message
    assert "['prompt', 'solution', 'solution.final']" in message and "--answer-key" in message
    with pytest.raises(ValueError, match=r"row 0: no prompt: found no 'body'"):
        load_examples(path, prompt_key="body")


def test_bad_values_and_files_are_named() -> None:
    with pytest.raises(ValueError, match=r"rows: row 0: 'prompt' must be a string or chat messages"):
        load_examples([{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 0: 'prompt' is empty"):
        load_examples([{"prompt": "  ", "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 0: 'answer' must be a string or a number, not list"):
        load_examples([{"prompt": "x", "answer": ["1"]}])
    with pytest.raises(ValueError, match=r"row 0 is a list"):
        load_examples([["x", "1"]])
    with pytest.raises(ValueError, match="no rows"):
        load_examples([])


def test_load_rows_reads_json_arrays_and_names_a_bad_line(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "x", "answer": "1"}]))
    assert load_rows(tmp_path / "a.json") == [{"prompt": "x", "answer": "1"}]
    (tmp_path / "b.jsonl").write_text('{"prompt": "x", "answer": "1"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"b.jsonl: line 2 is not JSON"):
        load_rows(tmp_path / "b.jsonl")
    (tmp_path / "c.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"unknown format '.csv'"):
        load_rows(tmp_path / "c.csv")


def test_split_held_out_is_seeded_and_disjoint() -> None:
    examples = [Example(f"{i}+0=", str(i)) for i in range(50)]
    train, held_out = split_held_out(examples, 5, seed=3)
    assert len(held_out) == 5 and len(train) == 45 and not set(map(str, train)) & set(map(str, held_out))
    assert split_held_out(examples, 5, seed=3) == (train, held_out)
    assert len(split_held_out(examples, 200, seed=0)[1]) == 10  # capped at a fifth of the data
    assert split_held_out(examples[:1], 5) == (examples[:1], examples[:1])  # one example: also the training set
    assert split_held_out(examples, 0) == (split_held_out(examples, 0)[0], [])
