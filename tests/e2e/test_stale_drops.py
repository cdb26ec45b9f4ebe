"""Halving k (`learner.halve_staleness_at`) makes a shard that waited under the old k stale.

The stages run in rounds (see `rounds`), so each shard's lag when the learner judges it is
fixed: with k = 2 halved to 1 from version 5, a shard two versions old is admitted at
version 2 and dropped at version 5, and the sample accounting holds with the drop in it.
"""

from __future__ import annotations

import pytest

from shardrl.orchestrate.accounting import account
from shardrl.stages.staleness import admitted, effective_k
from shardrl.store import LocalStore, RunKeys, parse_shard_key

from .conftest import learner_metric
from .rounds import one_thread, run_round, tiny_config

STEPS, K, HALVE_AT = 6, 2, 0.8  # k = 2 for versions 0-4, k = 1 from version 5 (0.8 * 6 = 4.8)
ROWS = 8  # a shard: 2 prompts x a group of 4 (the tiny settings)


def ledger(store: LocalStore, keys: RunKeys) -> list[dict]:
    return [store.get_json(key) for key in sorted(store.list(keys.root + "state/learn/ledger-"))]


def test_halving_k_drops_a_buffered_shard_as_stale_and_accounts_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, overrides=(
        "rollout.workers=1", f"learner.total_steps={STEPS}", f"learner.max_staleness={K}",
        f"learner.halve_staleness_at={HALVE_AT}"))
    assert [effective_k(K, v, STEPS, HALVE_AT) for v in range(STEPS)] == [2, 2, 2, 2, 2, 1]
    store, run_id = LocalStore(tmp_path / "store"), "halve"
    keys = RunKeys(run_id)

    def rounds(*stages: str) -> None:
        for stage in stages:
            run_round(store, cfg, run_id, stage)

    with one_thread():
        rounds("snapshot")
        # three shards of version 0, trained at versions 0, 1 and 2: the last one two
        # versions old, which k = 2 admits
        rounds("rollout", "rollout", "rollout", "learn", "learn", "learn")
        # three shards of version 3: trained at 3 and 4; the third waits until version 5,
        # where it is again two versions old, but k is 1 now
        rounds("rollout", "rollout", "rollout", "learn", "learn")
        # a fresh shard of version 5 makes the last step; the old one is dropped with it
        rounds("rollout", "learn")

    assert store.exists(keys.done())
    entries = ledger(store, keys)
    judged = []  # (learner version judging the shard, shard version, outcome)
    for d in entries:
        at = d["version"] - 1 if d["stepped"] else d["version"]
        judged += [(at, parse_shard_key(e["key"]).version, e["outcome"]) for e in d["shards"]]
    assert judged == [(0, 0, "admitted"), (1, 0, "admitted"), (2, 0, "admitted"),
                      (3, 3, "admitted"), (4, 3, "admitted"),
                      (5, 3, "stale"), (5, 5, "admitted")]
    # the rule the learner applied, halving included: lag 2 passes at version 2, not at 5,
    # where the k before halving would have admitted it too
    assert admitted(5, 3, K)
    for at, version, outcome in judged:
        k = effective_k(K, at, STEPS, HALVE_AT)
        assert admitted(at, version, k) == (outcome == "admitted"), (at, version, k)
    # every sample is accounted for: 7 shards generated, 6 trained on, one dropped as stale
    acc = account(store, keys)
    assert acc.balanced, acc.line()
    assert acc.stale_dropped == ROWS > 0
    assert (acc.generated, acc.consumed, acc.filtered, acc.quarantined, acc.unconsumed) == (
        7 * ROWS, 6 * ROWS, 0, 0, 0)
    stale_rows = sum(e["rows"] for d in entries for e in d["shards"] if e["outcome"] == "stale")
    assert stale_rows == acc.stale_dropped
    done = store.get_json(keys.done())
    assert done["steps"] == STEPS and done["counts"]["stale_dropped"] == ROWS
    # the learner logs, with each step's staleness, the k that admitted its batch (the k at
    # the version it started from: never below the staleness logged beside it), and the
    # drop in its running count
    assert learner_metric(tmp_path / "store", run_id, "k") == pytest.approx([2, 2, 2, 2, 2, 1])
    lags = learner_metric(tmp_path / "store", run_id, "staleness_max")
    assert all(lag <= k for lag, k in zip(lags, learner_metric(tmp_path / "store", run_id, "k"),
                                          strict=True)) and max(lags) == 2
    assert learner_metric(tmp_path / "store", run_id, "stale_dropped")[-1] == ROWS
