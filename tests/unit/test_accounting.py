"""Sample accounting over every way a run's shards can be stored: all three kinds (score and
prepare as stages), the ready shard alone (inline post-processing), and quarantined copies."""

from __future__ import annotations

import pyarrow as pa

from shardrl.orchestrate.accounting import account
from shardrl.store import LocalStore, RunKeys, quarantine, shards_by_name, write_shard
from shardrl.store.records import LedgerDelta, LedgerEntry, Progress
from shardrl.store.schemas import READY, ROLLOUT, SCORED


def rows(n: int, seq: int) -> pa.Table:
    """A ready table of `n` rows (groups of 2 samples) with every boundary column."""
    values = {
        "prompt_id": [f"p{seq}-{i // 2}" for i in range(n)],
        "group_id": [f"w00-{seq:06d}-{i // 2:03d}" for i in range(n)],
        "sample_idx": [i % 2 for i in range(n)], "policy_version": [0] * n, "worker": [0] * n,
        "prompt_text": ["ab="] * n, "prompt_token_ids": [[1, 2]] * n,
        "response_token_ids": [[3]] * n, "behavior_logprobs": [[-0.5]] * n,
        "finish_reason": ["stop"] * n, "response_text": ["c"] * n, "answer": ["c"] * n,
        "category": ["x"] * n, "created_at": [1.0] * n, "reward_verifier": [1.0] * n,
        "reward_model": [None] * n, "reward_rm": [1.0] * n, "correct": [True] * n,
        "reward_error": [None] * n, "ref_logprobs": [None] * n, "reward_total": [1.0] * n,
        "advantage": [0.0] * n, "keep": [False] * n, "filter_reason": ["zero_variance"] * n,
    }
    return pa.table({f.name: pa.array(values[f.name], f.type) for f in READY}, schema=READY)


def cut(table: pa.Table, schema: pa.Schema) -> pa.Table:
    return table.select(schema.names)


def test_generated_rows_come_from_whichever_shard_of_a_name_exists(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r")
    staged, inline, waiting, moved_ready, moved_rollout = (keys.rollout(0, 0, s) for s in range(5))
    # staged: all three kinds, consumed; inline and waiting: the ready shard alone
    t = rows(8, 0)
    write_shard(store, staged, cut(t, ROLLOUT), ROLLOUT)
    write_shard(store, keys.scored_for(staged), cut(t, SCORED), SCORED)
    write_shard(store, keys.ready_for(staged), t, READY)
    for key, n in ((inline, 4), (waiting, 6), (moved_ready, 2)):
        write_shard(store, keys.ready_for(key), rows(n, 1), READY)
    # the learner moved away an inline worker's only shard; score moved a rollout shard
    quarantine(store, keys.ready_for(moved_ready), "learn", ValueError("bad"))
    write_shard(store, moved_rollout, cut(rows(3, 2), ROLLOUT), ROLLOUT)
    quarantine(store, moved_rollout, "score", ValueError("bad"))
    assert set(shards_by_name(store, keys, ("rollouts", "ready"))) == \
        {"v000000/w00-000000.parquet", "v000000/w00-000001.parquet",
         "v000000/w00-000002.parquet"}
    assert shards_by_name(store, keys, ("rollouts", "ready"))["v000000/w00-000000.parquet"] \
        == staged  # the first kind that has the name
    # the learner committed staged (8 rows: 5 consumed, 3 filtered) and inline (4: all consumed)
    LedgerDelta(version=0, stepped=True, shards=[
        LedgerEntry(key=keys.ready_for(staged), outcome="admitted", rows=8),
        LedgerEntry(key=keys.ready_for(inline), outcome="admitted", rows=4)],
    ).write(store, keys.ledger(0))
    Progress(version=1, commits=1, counts={"consumed": 9, "filtered": 3}).write(
        store, keys.progress())
    acc = account(store, keys)
    # 8 + 4 + 6 + 2 + 3 generated = 9 consumed + 3 filtered + 5 quarantined + 6 unconsumed
    assert (acc.generated, acc.consumed, acc.filtered, acc.quarantined, acc.unconsumed,
            acc.stale_dropped) == (23, 9, 3, 5, 6, 0)
    assert acc.balanced and acc.unreadable_quarantined_shards == 0


def test_a_quarantined_derived_shard_counts_the_rows_of_its_name_once(tmp_path):
    """Prepare moved a scored shard away: its rollout shard still holds the rows, which are
    generated once and quarantined once."""
    store, keys = LocalStore(tmp_path), RunKeys("r")
    key = keys.rollout(3, 1, 7)
    t = rows(5, 0)
    write_shard(store, key, cut(t, ROLLOUT), ROLLOUT)
    write_shard(store, keys.scored_for(key), cut(t, SCORED), SCORED)
    quarantine(store, keys.scored_for(key), "prepare", ValueError("bad"))
    acc = account(store, keys)
    assert (acc.generated, acc.quarantined, acc.unconsumed) == (5, 5, 0) and acc.balanced


def test_a_delta_written_without_its_progress_record_is_not_committed(tmp_path):
    """A commit writes its ledger delta, then progress.json. A learner stopped between the
    two leaves a delta whose shards the counts do not include: they are still waiting (the
    restarted learner takes them again), so they count as unconsumed, and the accounting
    holds. It used to count them as committed and report that it did not hold."""
    store, keys = LocalStore(tmp_path), RunKeys("r")
    first, second = keys.rollout(0, 0, 0), keys.rollout(0, 0, 1)
    write_shard(store, keys.ready_for(first), rows(4, 0), READY)
    write_shard(store, keys.ready_for(second), rows(6, 1), READY)
    LedgerDelta(version=0, stepped=True, shards=[
        LedgerEntry(key=keys.ready_for(first), outcome="admitted", rows=4)],
    ).write(store, keys.ledger(1))
    Progress(version=1, commits=1, counts={"consumed": 3, "filtered": 1}).write(
        store, keys.progress())
    # the second commit's delta, written just before the learner stopped
    LedgerDelta(version=1, stepped=True, shards=[
        LedgerEntry(key=keys.ready_for(second), outcome="admitted", rows=6)],
    ).write(store, keys.ledger(2))
    acc = account(store, keys)
    # 4 + 6 generated = 3 consumed + 1 filtered + 6 unconsumed
    assert (acc.generated, acc.consumed, acc.filtered, acc.unconsumed) == (10, 3, 1, 6)
    assert acc.balanced, acc.line()
    # once its progress record lands the same shards are committed: 5 consumed, 1 filtered
    Progress(version=2, commits=2, counts={"consumed": 8, "filtered": 2}).write(
        store, keys.progress())
    acc = account(store, keys)
    assert (acc.consumed, acc.filtered, acc.unconsumed) == (8, 2, 0)
    assert acc.balanced, acc.line()


def test_a_shard_nobody_can_read_is_not_counted_as_empty(tmp_path):
    """A generated shard, not quarantined, that is not Parquet cannot be counted: the balance
    does not hold, and says which shard; a store that fails while counting raises instead of
    counting its shards as empty."""
    import pytest

    from shardrl.store import StoreUnavailable

    store, keys = LocalStore(tmp_path), RunKeys("r")
    write_shard(store, keys.ready_for(keys.rollout(0, 0, 0)), rows(4, 0), READY)
    rotten = keys.ready_for(keys.rollout(0, 0, 1))
    store.put_bytes(rotten, b"PAR1 not really")
    acc = account(store, keys)
    assert (acc.generated, acc.unconsumed) == (4, 4)  # the readable one
    assert acc.unreadable_shards == [rotten] and not acc.balanced
    assert "1 generated shard(s) unreadable, e.g. " + rotten in acc.line()
    quarantine(store, rotten, "learn", ValueError("bad"))  # the learner moves it away
    acc = account(store, keys)
    assert acc.balanced and acc.unreadable_quarantined_shards == 1

    class Down(LocalStore):
        def get_bytes(self, key):
            raise StoreUnavailable("the store stopped answering")

    with pytest.raises(StoreUnavailable):
        account(Down(tmp_path), keys)
