"""The learner's count of prompt groups in a row with nothing kept by filtering."""

from __future__ import annotations

import pyarrow as pa

from shardrl.stages.learn.loop import Barren


def rows(groups: list[str], correct: list[bool], reward: list[float]) -> pa.Table:
    return pa.table({"group_id": groups, "correct": correct, "reward_total": reward})


def test_barren_steps_add_up_and_a_kept_row_starts_over():
    b = Barren()
    solved = rows(["g1", "g1", "g2", "g2"], [True] * 4, [1.0] * 4)
    b.add(solved, solved.slice(0, 0))
    assert (b.groups, b.rows, b.correct) == (2, 4, 4) and b.all_correct()
    failed = rows(["g3", "g3"], [False, False], [0.0, 0.0])
    b.add(failed, failed.slice(0, 0))
    assert (b.groups, b.rows, b.correct) == (3, 6, 4)
    assert not b.all_correct() and b.mean_reward() == 4.0 / 6
    b.add(solved, solved.slice(0, 1))  # one row kept: the run of barren steps ends
    assert (b.groups, b.rows, b.correct) == (0, 0, 0) and not b.all_correct()
