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


def test_a_row_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl: row 2: not UTF-8 \(byte 0xe9 at column "
                       r"16\)"):
        load_items(path)


def test_a_prompt_given_twice_with_two_answers_is_a_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [{"prompt": "a", "answer": "1", "prompt_id": "p1"},
                       {"prompt": "a", "answer": "2", "prompt_id": "p2"},
                       {"prompt": "a", "answer": "1", "prompt_id": "p3"}])
    with pytest.raises(DatasetError, match=r"row 2: the prompt of row 1 again, with another "
                       r"answer \('2', not '1'\)"):
        load_items(path)


def test_parquet_reads_the_columns_a_task_uses_only(tmp_path):
    """A column the task does not use (here of a type no row could hold) is not read."""
    table = pa.table({"prompt": ["a", "b"], "answer": ["1", "2"],
                      "notes": pa.array([{"x": [1.0]}, {"x": [2.0]}])})
    pq.write_table(table, tmp_path / "d.parquet")
    items = load_items(tmp_path / "d.parquet")
    assert [(it.prompt, it.answer) for it in items] == [("a", "1"), ("b", "2")]


def test_held_out_prompts_are_left_out_of_training_and_every_character_is_known(tmp_path,
                                                                                 caplog):
    """A prompt in both files would be trained on and make the held-out pass rate read high;
    a character only the held-out set uses would be unknown to the tiny tokenizer."""
    from shardrl.config import RunConfig
    from shardrl.tasks.source import _make_task as make_task  # not the cached one

    train, heldout = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    write_jsonl(train, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)])
    write_jsonl(heldout, [{"prompt": "3+1=", "answer": "4"}, {"prompt": "0-5=", "answer": "-5"}])
    cfg = RunConfig.model_validate({"task": {"source": {
        "kind": "dataset", "train_path": str(train), "eval_path": str(heldout)}}})
    task = make_task(cfg)
    trained = {it.prompt for it in task.validation} | {
        it.prompt for seq in range(20) for it in task.train_items(0, seq, 4)}
    assert "3+1=" not in trained and len(trained) == 29
    assert "1 training row(s) of" in caplog.text and "'3+1='" in caplog.text
    assert "-" in "".join(task.corpus)
    write_jsonl(train, [{"prompt": "3+1=", "answer": "4"}, {"prompt": "4+1=", "answer": "5"}])
    with pytest.raises(DatasetError, match="1 training row"):
        make_task(cfg)
    # a copy that differs only in spaces is the same prompt to a chat template that trims
    write_jsonl(train, [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}
                        for i in range(30)])
    write_jsonl(heldout, [{"prompt": "What is  3 plus 1? ", "answer": "4"}])
    task = make_task(cfg)
    trained = {it.prompt for it in task.validation} | {
        it.prompt for seq in range(20) for it in task.train_items(0, seq, 4)}
    assert "What is 3 plus 1?" not in trained and len(trained) == 29


def test_line_endings_of_any_kind_and_answers_equal_as_numbers_load(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\r{"prompt": "b", "answer": "2"}\r')
    assert [it.prompt for it in load_items(path)] == ["a", "b"]
    # a JSON string may hold U+2028 or U+0085 as they are: no line ends there
    path.write_text(json.dumps({"prompt": "a\u2028b\u0085c", "answer": "1"}, ensure_ascii=False)
                    + "\n" + json.dumps({"prompt": "d", "answer": " 2 "}) + "\n"
                    + json.dumps({"prompt": "d", "answer": "2", "prompt_id": "d2"}) + "\n")
    assert [it.prompt for it in load_items(path)] == ["a\u2028b\u0085c", "d", "d"]
    # every bad row is listed, with its own number, whatever the line ends
    path.write_bytes(b'{"prompt": "\xe9", "answer": "1"}\r{"prompt": "b"}\r'
                     b'{"prompt": "c\xff", "answer": "2"}\r')
    with pytest.raises(DatasetError) as caught:
        load_items(path)
    assert "3 problem(s)" in str(caught.value)
    assert "row 1: not UTF-8" in str(caught.value) and "row 3: not UTF-8" in str(caught.value)
