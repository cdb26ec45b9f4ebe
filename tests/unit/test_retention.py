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
                               "learner.total_steps=100", f"promote.choose={how}"])
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
    assert retention.collect(35) == [31, {"best": 10, "last": 20}[how]]
    assert present(store, keys) == [0, 30, 32, 33, 34]
    # a restarted learner finds what the earlier one kept past the horizon and goes on
    again = Retention(store, keys, cfg, version=35)
    assert again.waiting == [30]
    evaluated(store, keys, {40: 0.95})  # 40 is not even published here: still, 30 is outranked
    assert again.collect(36) == [32, 30]
    assert present(store, keys) == [0, 33, 34]


def test_a_version_better_than_every_later_one_stays(tmp_path):
    cfg = load_config("demo", ["learner.max_staleness=0", "eval.every=2",
                               "learner.total_steps=8"])
    store, keys = LocalStore(tmp_path), RunKeys("r")
    for v in range(9):
        store.put_bytes(keys.policy_file(v, "model.safetensors"), b"w")
    retention = Retention(store, keys, cfg, version=2)
    evaluated(store, keys, {0: 0.1, 2: 0.9, 4: 0.3, 6: 0.5, 8: 0.4})
    for v in range(3, 9):
        retention.collect(v)
    # horizon 6: 2 is the best of all and stays; 4 and 6 are outranked by it
    assert present(store, keys) == [0, 2, 7, 8]
