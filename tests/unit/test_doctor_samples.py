"""The sample audit: row selection by reward and the text table."""

from __future__ import annotations

import pyarrow as pa

from shardrl.doctor.samples import format_table, select


def table() -> pa.Table:
    return pa.table({
        "policy_version": [3, 3, 3, 3],
        "prompt_text": ["1+1=", "2+2=", "3+3=", "4+4="],
        "response_text": ["2", "5", "6\nextra", "0"],
        "response_token_ids": [[5], [6], [7, 1, 2, 3, 4, 5, 6], [0]],
        "finish_reason": ["stop", "stop", "length", "stop"],
        "reward_rm": [1.0, 0.0, 0.5, -1.0],
        "correct": [True, False, False, False],
    })


def test_worst_best_and_stored_order():
    assert [r["reward"] for r in select(table(), "worst", 2)] == [-1.0, 0.0]
    assert [r["prompt"] for r in select(table(), "best", 2)] == ["1+1=", "3+3="]
    assert [r["prompt"] for r in select(table(), "stored", 3)] == ["1+1=", "2+2=", "3+3="]
    assert len(select(table(), "worst", 10)) == 4  # n larger than the table: every row


def test_random_draw_is_a_permutation_of_rows():
    rows = select(table(), "random", 4, seed=0)
    assert sorted(r["prompt"] for r in rows) == ["1+1=", "2+2=", "3+3=", "4+4="]


def test_table_shows_lengths_and_escapes_newlines():
    rows = select(table(), "best", 2)
    lines = format_table(rows, text_width=5).splitlines()
    assert lines[0].split() == ["version", "reward", "ok", "len", "finish", "prompt", "response"]
    assert len(lines) == 2 + 2  # header, rule, two rows
    assert lines[3].split()[:5] == ["3", "0.5", "False", "7", "length"]
    # "6\nextra" escaped is the 8 characters 6 \ n e x t r a: the first 4 and "~" make 5
    assert lines[3].split()[-1] == "6\\ne~"
    assert format_table([]) == "(no samples)"
