"""The staleness rule and flow control, on hand-worked numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.stages.staleness import (
    admitted,
    backlog_cap,
    batch_shards,
    effective_k,
    gc_horizon,
    group_cap,
    keep_rate,
    kept_backlog,
    lead_cap,
    standby_count,
    step_ready,
    steps_ahead,
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
    assert steps_ahead(1, 8) == 1 and steps_ahead(3, 2) == 2 and steps_ahead(3, 0) == 0
    assert backlog_cap(worker_share(16, 2), steps_ahead(1, 8)) == 16
    assert backlog_cap(16, steps_ahead(3, 8)) == 64
    assert backlog_cap(16, steps_ahead(3, 2)) == 48  # never beyond k steps ahead
    assert backlog_cap(16, steps_ahead(3, 0)) == 16  # synchronous: one step
    # counted from the take, the step being trained no longer counts
    assert lead_cap(8, 1) == 8 and lead_cap(16, 3) == 48


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
    # a worker with a cap of 16 kept groups may have 8 x 16 = 128 groups waiting, kept or not
    assert group_cap(16) == 128
    # nothing kept so far (kept_per_shard 0) but 40 groups of room left at 16 per shard:
    # 3 shards (2.5 rounded up), not the 8 the kept room alone would allow
    assert batch_shards(5, 0.0, 8, group_room=40, groups_per_shard=16) == 3
    assert batch_shards(32, 4.0, 8, group_room=1000, groups_per_shard=16) == 8
    assert batch_shards(32, 4.0, 8, group_room=0, groups_per_shard=16) == 1  # at least one


def test_the_learner_steps_on_kept_groups_or_on_many_filtered_ones():
    # B=16 from 2 workers (share 8): 16 kept groups, or 128 groups of any kind, or 64 from
    # one worker
    assert step_ready(16, 16, 8, 16, 2)
    assert not step_ready(15, 127, 63, 16, 2)
    assert step_ready(0, 128, 64, 16, 2)
    assert step_ready(13, 94, 64, 16, 2)
    # one worker: its share is the batch, the per-worker rule is the total one
    assert not step_ready(15, 127, 127, 16, 1)
    assert step_ready(2, 128, 128, 16, 1)


def test_a_worker_paused_on_kept_groups_and_one_paused_on_groups_do_not_deadlock():
    # at k=0, B=16, 2 workers (cap 8 kept groups, 64 of any kind): worker 0 is paused with
    # 8 kept of 24 waiting, worker 1 with 5 kept of 64 waiting; 13 kept and 88 groups fill
    # neither a batch nor the 128-group limit, but worker 1's 64 groups make the step
    cap = backlog_cap(worker_share(16, 2), steps_ahead(1, 0))
    assert (cap, group_cap(cap)) == (8, 64)
    assert step_ready(8 + 5, 24 + 64, 64, 16, 2)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 4), st.integers(0, 16),
       st.data())
def test_once_every_worker_is_paused_the_learner_can_step(batch, workers, backlog_steps, k,
                                                          data):
    """The invariant the flow control rests on: a worker pauses at its cap of kept groups or
    at its cap of groups of any kind; whatever mix of the two the workers are paused in, the
    groups they left for the learner make a step."""
    cap = backlog_cap(worker_share(batch, workers), steps_ahead(backlog_steps, k))
    kept, groups = [], []
    for _ in range(workers):
        if data.draw(st.booleans()):  # paused on kept groups
            n_kept = data.draw(st.integers(cap, 4 * cap))
            n_groups = data.draw(st.integers(n_kept, n_kept + group_cap(cap) - 1))
        else:  # paused on groups of any kind, however few of them were kept
            n_groups = data.draw(st.integers(group_cap(cap), 2 * group_cap(cap)))
            n_kept = data.draw(st.integers(0, min(cap - 1, n_groups)))
        kept.append(n_kept)
        groups.append(n_groups)
    assert step_ready(sum(kept), sum(groups), max(groups), batch, workers)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 9), st.integers(0, 4),
       st.integers(0, 16), st.booleans(), st.data())
def test_with_standby_workers_and_the_lead_from_the_take_the_learner_can_step_too(
        batch, workers, standby_setting, backlog_steps, k, at_take, data):
    """The same with unequal shares: the last `standby_count` workers (share B / W) may all
    stand by, writing nothing, while the others (share B / (W - S)) are paused; with the lead
    counted from the take a worker pauses on kept groups at `lead_cap` of those not yet
    taken, which for a learner waiting for data are all those not yet committed."""
    standby = standby_count(standby_setting, workers)
    assert 0 <= standby < workers
    ahead = steps_ahead(backlog_steps, k)
    kept, groups = [], []
    for worker in range(workers):
        on_standby = worker >= workers - standby
        if on_standby and data.draw(st.booleans()):  # not called in: may have written nothing
            kept.append(0)
            groups.append(0)
            continue
        share = worker_share(batch, workers if on_standby or not standby else workers - standby)
        cap = backlog_cap(share, ahead)  # its group cap counts from it in both modes
        kept_cap = lead_cap(share, ahead) if at_take and ahead >= 1 else cap
        if data.draw(st.booleans()):  # paused on kept groups
            n_kept = data.draw(st.integers(kept_cap, 4 * kept_cap))
            n_groups = data.draw(st.integers(n_kept, n_kept + group_cap(cap) - 1))
        else:  # paused on groups of any kind
            n_groups = data.draw(st.integers(group_cap(cap), 2 * group_cap(cap)))
            n_kept = data.draw(st.integers(0, min(kept_cap - 1, n_groups)))
        kept.append(n_kept)
        groups.append(n_groups)
    assert step_ready(sum(kept), sum(groups), max(groups), batch, workers)


def test_gc_horizon():
    # at version 20 with k=8 a shard of version 12 is still admissible, and one of version
    # 11 may still be in flight from a worker one version behind: 10 is the newest to delete
    assert gc_horizon(20, 8) == 10
    assert gc_horizon(3, 8) < 0
