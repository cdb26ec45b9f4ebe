"""The staleness rule and flow control, on hand-worked numbers."""

from __future__ import annotations

from shardrl.stages.staleness import (
    admitted,
    backlog_cap,
    batch_shards,
    effective_k,
    gc_horizon,
    group_cap,
    keep_rate,
    kept_backlog,
    worker_share,
)


def test_effective_k_halves_from_the_given_fraction_of_the_run():
    # 100 steps, halve at 0.8: k=8 through version 79, k=4 from version 80 on
    assert effective_k(8, 0, 100, 0.8) == 8
    assert effective_k(8, 79, 100, 0.8) == 8
    assert effective_k(8, 80, 100, 0.8) == 4
    assert effective_k(8, 99, 100, 0.8) == 4
    assert effective_k(7, 80, 100, 0.8) == 3  # rounded down
    assert effective_k(1, 90, 100, 0.8) == 0  # k=1 becomes synchronous
    assert effective_k(8, 99, 100, None) == 8  # never halved when unset
    # 60 steps at 0.5: from version 30 on
    assert [effective_k(6, v, 60, 0.5) for v in (29, 30)] == [6, 3]


def test_admission_is_lag_at_most_k():
    assert admitted(10, 2, 8) and not admitted(10, 1, 8)
    assert admitted(5, 5, 0) and not admitted(5, 4, 0)  # k=0: only the current version
    # the halved k drops what the full k admitted
    k = effective_k(8, 80, 100, 0.8)
    assert admitted(80, 76, k) and not admitted(80, 75, k)


def test_backlog_cap_in_kept_groups_bounded_by_k():
    # B=16 over 2 workers: 8 groups each; one step beyond the one being trained
    assert worker_share(16, 2) == 8 and worker_share(16, 3) == 6  # rounded up
    assert backlog_cap(16, 2, max_backlog_steps=1, k=8) == 16
    assert backlog_cap(16, 1, max_backlog_steps=3, k=8) == 64
    assert backlog_cap(16, 1, max_backlog_steps=3, k=2) == 48  # never beyond k steps ahead
    assert backlog_cap(16, 1, max_backlog_steps=3, k=0) == 16  # synchronous: one step


def test_kept_backlog_and_keep_rate():
    assert kept_backlog(40, 32) == 8
    assert kept_backlog(30, 32) == 0  # a restarted worker's undercount never goes negative
    assert keep_rate(12, 48) == 0.25
    assert keep_rate(0, 0) == 1.0 and keep_rate(0, 0, prior=0.5) == 0.5


def test_batch_shards_fill_the_room_between_one_and_the_maximum():
    # 32 kept groups of room at 4 kept per shard: 8 shards, capped at 6
    assert batch_shards(32, 4.0, 8) == 8
    assert batch_shards(32, 4.0, 6) == 6
    assert batch_shards(10, 4.0, 8) == 3  # rounded up: 2.5 shards
    assert batch_shards(0, 4.0, 8) == 1  # always at least one
    assert batch_shards(-3, 4.0, 8) == 1
    assert batch_shards(5, 0.0, 8) == 8  # nothing kept so far: the largest batch


def test_groups_of_any_kind_are_bounded_too():
    # a worker with a cap of 16 kept groups may have 8 x 16 = 128 groups waiting, kept or not;
    # two such workers hold 256 >= the 8 batches of 16 the learner steps on when few are kept
    assert group_cap(16) == 128
    assert 2 * group_cap(backlog_cap(16, 2, max_backlog_steps=1, k=0)) >= 8 * 16
    # nothing kept so far (kept_per_shard 0) but 40 groups of room left at 16 per shard:
    # 3 shards (2.5 rounded up), not the 8 the kept room alone would allow
    assert batch_shards(5, 0.0, 8, group_room=40, groups_per_shard=16) == 3
    assert batch_shards(32, 4.0, 8, group_room=1000, groups_per_shard=16) == 8
    assert batch_shards(32, 4.0, 8, group_room=0, groups_per_shard=16) == 1  # at least one


def test_gc_horizon():
    # at version 20 with k=8 a shard of version 12 is still admissible, and one of version
    # 11 may still be in flight from a worker one version behind: 10 is the newest to delete
    assert gc_horizon(20, 8) == 10
    assert gc_horizon(3, 8) < 0
