"""User datasets: JSONL and Parquet rows become TaskItems; bad rows are all reported."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardrl.tasks.builtin import TaskItem
from shardrl.tasks.datasets import DatasetError, load_items, prompt_id_of


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_rows_become_items(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "2+2=", "answer": "4"},
            "",  # blank lines are skipped
            {"prompt": "3*3=", "answer": 9, "category": "mul", "prompt_id": "q9"},
        ],
    )
    items = load_items(path)
    # Absent prompt_id: 6-byte blake2b of the prompt, the built-in task's scheme.
    expected_id = hashlib.blake2b(b"2+2=", digest_size=6).hexdigest()
    assert items == [
        TaskItem(prompt_id=expected_id, prompt="2+2=", answer="4", category="default"),
        TaskItem(prompt_id="q9", prompt="3*3=", answer="9", category="mul"),
    ]
    assert prompt_id_of("2+2=") == expected_id and len(expected_id) == 12


def test_parquet_rows_become_items(tmp_path):
    table = pa.table({"prompt": ["a?", "b?"], "answer": ["1", "2"], "category": ["x", None]})
    pq.write_table(table, tmp_path / "d.parquet")
    items = load_items(tmp_path / "d.parquet")
    assert [(i.prompt, i.answer, i.category) for i in items] == [
        ("a?", "1", "x"),
        ("b?", "2", "default"),
    ]


def test_every_bad_row_is_reported_with_file_row_and_column(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "ok", "answer": "1"},  # row 1 fine
            {"prompt": "no answer"},  # row 2
            {"answer": "no prompt"},  # row 3
            "{not json",  # row 4
            {"prompt": "ok", "answer": "2"},  # row 5: same prompt -> same id as row 1
            {"prompt": "  ", "answer": None},  # row 6: two problems
        ],
    )
    with pytest.raises(DatasetError) as err:
        load_items(path)
    message = str(err.value)
    assert message.startswith(f"6 problem(s) in {path}")
    assert f"{path}: row 2: missing column 'answer'" in message
    assert f"{path}: row 3: missing column 'prompt'" in message
    assert f"{path}: row 4: invalid JSON" in message
    assert f"{path}: row 5: duplicate prompt_id '{prompt_id_of('ok')}' (first at row 1)" in message
    assert f"{path}: row 6: column 'prompt' is empty" in message
    assert f"{path}: row 6: missing column 'answer'" in message
    assert "row 1:" not in message


def test_error_list_is_capped(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": f"p{i}"} for i in range(30)])
    with pytest.raises(DatasetError) as err:
        load_items(path, max_errors=5)
    # 30 bad rows, 5 shown, 25 summarised.
    assert str(err.value).count("missing column 'answer'") == 5
    assert "... and 25 more" in str(err.value)


def test_parquet_without_answer_column_and_unknown_format(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match="no column 'answer'"):
        load_items(tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        load_items(tmp_path / "d.csv")
