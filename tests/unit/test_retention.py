"""Policy retention: recent versions for admissible shards, owed evaluations, and only the
evaluated version promotion can still choose; the store stays bounded however long the run."""

from __future__ import annotations

import pytest

from shardrl.config import load_config
from shardrl.stages.retention import Retention, outranked
from shardrl.store import LocalStore, RunKeys


def test_outranked_by_metric_then_newer_or_by_newer_only():
    s = {0: 0.5, 10: 0.8, 20: 0.7, 30: 0.8}
    assert outranked(20, s, "best") and outranked(0, s, "best")
    assert outranked(10, s, "best")  # 30 ties on the metric and is newer: promotion's pick
    assert not outranked(30, s, "best")
    assert outranked(10, s, "last") and not outranked(30, s, "last")


def test_a_nan_metric_ranks_below_every_number_for_retention_and_promotion_alike():
    """A version whose metric is NaN was never outranked, so retention kept it and its chain
    for good, and promotion's max() could pick it, depending on the order of the versions."""
    from shardrl.stages.promote import choose

    nan = float("nan")
    s = {0: 0.5, 10: nan, 20: 0.7}
    assert outranked(10, s, "best") and not outranked(20, s, "best")
    for order in ([0, 10, 20], [10, 20, 0], [20, 0, 10]):
        summaries = {v: {"pass_at_1": s[v]} for v in order}
        assert choose(summaries, "pass_at_1", "best") == 20
    assert choose({10: {"pass_at_1": nan}, 20: {"pass_at_1": nan}}, "pass_at_1", "best") == 20


def present(store: LocalStore, keys: RunKeys) -> list[int]:
    prefix = keys.root + "policy/"
    return sorted({int(k[len(prefix) + 1:].split("/")[0]) for k in store.list(prefix)})


def evaluated(store: LocalStore, keys: RunKeys, results: dict[int, float]) -> None:
    for v, p in results.items():
        store.put_json(keys.eval_summary(v), {"pass_at_1": p})
    store.put_json(keys.eval_latest(), {"version": max(results)})


@pytest.mark.parametrize("how", ["best", "last"])
def test_long_run_keeps_recent_owed_and_choosable_versions(tmp_path, how):
    # k = 2: a commit of version v makes v - 4 unneeded by any admissible shard
    cfg = load_config("demo", ["learner.max_staleness=2", "eval.every=10",
                               "learner.total_steps=100", f"promote.choose={how}",
                               "learner.publish.full_every=1"])
    store, keys = LocalStore(tmp_path), RunKeys("r")
    for v in range(35):
        store.put_bytes(keys.policy_file(v, "model.safetensors"), b"w")
    retention = Retention(store, keys, cfg, version=4)
    evaluated(store, keys, {0: 0.5, 10: 0.8, 20: 0.7})  # 30 is not evaluated yet
    for v in range(5, 35):
        retention.collect(v)
    # horizon 30: 1..29 gone but for the evaluated ones promotion may choose; 30 is owed an
    # evaluation; 31..34 may still have admissible shards; 0 is the snapshot
    kept = {"best": [0, 10, 30, 31, 32, 33, 34], "last": [0, 20, 30, 31, 32, 33, 34]}[how]
    assert present(store, keys) == kept
    # 30 evaluated best of all: the older evaluated version goes at the next commit
    evaluated(store, keys, {30: 0.9})
    assert retention.collect(35) == sorted([31, {"best": 10, "last": 20}[how]])
    assert present(store, keys) == [0, 30, 32, 33, 34]
    # a restarted learner finds what the earlier one kept past the horizon and goes on
    again = Retention(store, keys, cfg, version=35)
    assert again.waiting == [30]
    evaluated(store, keys, {40: 0.95})  # 40 is not even published here: still, 30 is outranked
    assert again.collect(36) == [30, 32]
    assert present(store, keys) == [0, 33, 34]


def test_a_version_better_than_every_later_one_stays(tmp_path):
    cfg = load_config("demo", ["learner.max_staleness=0", "eval.every=2",
                               "learner.total_steps=8", "learner.publish.full_every=1"])
    store, keys = LocalStore(tmp_path), RunKeys("r")
    for v in range(9):
        store.put_bytes(keys.policy_file(v, "model.safetensors"), b"w")
    retention = Retention(store, keys, cfg, version=2)
    evaluated(store, keys, {0: 0.1, 2: 0.9, 4: 0.3, 6: 0.5, 8: 0.4})
    for v in range(3, 9):
        retention.collect(v)
    # horizon 6: 2 is the best of all and stays; 4 and 6 are outranked by it
    assert present(store, keys) == [0, 2, 7, 8]


def test_deltas_keep_the_chain_back_to_their_full_snapshot(tmp_path):
    # full snapshots at multiples of 4, deltas between; k = 0: committing v makes v - 2 old
    cfg = load_config("demo", ["learner.max_staleness=0", "eval.every=5",
                               "learner.total_steps=40", "learner.publish.full_every=4"])
    store, keys = LocalStore(tmp_path), RunKeys("r")
    for v in range(15):
        store.put_bytes(keys.policy_file(v, "model.safetensors"), b"w")
    retention = Retention(store, keys, cfg, version=2)
    evaluated(store, keys, {0: 0.1, 5: 0.9})
    for v in range(3, 15):
        retention.collect(v)
    # horizon 12: the newest needed version 13 is a delta on 12 (full); 5 was evaluated best,
    # so it keeps its chain 4 (full) and 5; 10 is owed an evaluation: 8 (full), 9, 10
    assert present(store, keys) == [0, 4, 5, 8, 9, 10, 12, 13, 14]
    # 10 evaluated better than 5: 4 and 5 go; then 9 needs only its own chain (8)
    evaluated(store, keys, {10: 0.95})
    assert retention.collect(15) == [4, 5]
    assert present(store, keys) == [0, 8, 9, 10, 12, 13, 14]
    # 15's chain (12 to 15) is needed while 15 may have admissible shards, then while it is
    # owed an evaluation; evaluated below 10, it goes with its chain (15 is not stored here)
    assert retention.collect(16) == []
    evaluated(store, keys, {15: 0.5})
    assert retention.collect(17) == [12, 13, 14, 15]
    assert present(store, keys) == [0, 8, 9, 10]
    # a restarted learner rebuilds the same picture from the listing
    again = Retention(store, keys, cfg, version=17)
    assert again.waiting == [10] and again.old == {8, 9, 10}
    assert again.collect(18) == []
