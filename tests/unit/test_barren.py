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


def test_the_count_a_commit_records_is_the_count_a_resumed_learner_goes_on_from():
    b = Barren()
    assert b.state() == {}  # nothing to carry
    failed = rows(["g1", "g1", "g2", "g2", "g3", "g3"], [True, True, False, False, True, True],
                  [1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    b.add(failed, failed.slice(0, 0))
    assert b.state() == {"groups": 3, "rows": 6, "correct": 4, "reward": 3.0}
    again = Barren.resumed(b.state())
    assert (again.groups, again.rows, again.correct, again.reward) == (3, 6, 4, 3.0)
    assert again.mean_reward() == 0.5 and not again.all_correct()
    more = rows(["g4", "g4"], [True, True], [1.0, 1.0])
    again.add(more, more.slice(0, 0))
    assert again.state() == {"groups": 4, "rows": 8, "correct": 6, "reward": 5.0}
    fresh = Barren.resumed({})  # a progress record written before the count was kept
    assert (fresh.groups, fresh.rows, fresh.correct, fresh.reward) == (0, 0, 0, 0.0)
