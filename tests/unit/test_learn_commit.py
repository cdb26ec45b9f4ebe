"""The learner's commit bookkeeping on hand-built shards: lag counts, the ledger's per-worker
tallies (counted at read time or here), and the writer's order."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from shardrl.stages.learn.commit import Ledger, Writer
from shardrl.store import RunKeys
from shardrl.store.records import Progress

KEYS = RunKeys("r1")


def shard(groups: list[list[bool]], version: int = 0) -> pa.Table:
    """Rows of `groups` (one `keep` flag per sample) at policy `version`."""
    gid = [f"g{g}" for g, keeps in enumerate(groups) for _ in keeps]
    keep = [k for keeps in groups for k in keeps]
    return pa.table({"group_id": gid, "keep": keep, "policy_version": [version] * len(keep)})


def test_lags_count_admitted_samples_by_version_behind():
    ledger = Ledger(Progress())
    ledger.lags(5, pa.concat_tables([shard([[True, True]], 5), shard([[True, False, True]], 3)]))
    ledger.lags(6, shard([[True]], 5))
    assert dict(ledger.staleness) == {0: 2, 2: 3, 1: 1}


def test_record_counts_rows_groups_and_uses_tallies_when_given():
    a = KEYS.shard("ready", 0, 0, 0)
    b = KEYS.shard("ready", 1, 1, 3)
    batch = [(a, shard([[True, True], [False, False]]), "admitted"),
             (b, shard([[True, False], [False]], 1), "stale")]
    counted = Ledger(Progress())
    delta = counted.record(batch)
    assert [(e.key, e.outcome, e.rows) for e in delta] == [(a, "admitted", 4), (b, "stale", 3)]
    assert dict(counted.counts) == {"consumed": 2, "filtered": 2, "stale_dropped": 3}
    # worker 0: 2 groups, 1 kept; worker 1: 2 groups, 1 kept (a group with a kept row)
    assert dict(counted.groups_by_worker) == {0: 2, 1: 2}
    assert dict(counted.kept_by_worker) == {0: 1, 1: 1}
    assert counted.names == {0: ["w00-000000.parquet"], 1: ["w01-000003.parquet"]}
    # the same batch with the reader's tallies: taken as given, not recounted
    told = Ledger(Progress())
    told.record(batch, {a: (0, 7, 5)})
    assert dict(told.groups_by_worker) == {0: 7, 1: 2}
    assert dict(told.kept_by_worker) == {0: 5, 1: 1}


def test_writer_runs_later_work_after_the_commit_in_flight_without_waiting():
    writer, gate, order = Writer(), threading.Event(), []
    try:
        writer.submit(lambda: (gate.wait(5), order.append("commit")))
        writer.later(order.append, "cursor")  # returns while the commit is still held
        assert order == []
        gate.set()
        writer.wait()
        assert order == ["commit", "cursor"]
        writer.later(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            writer.submit(order.append, "next")  # the queued error surfaces at the next submit
    finally:
        writer.close()


def test_writer_skips_later_work_queued_behind_a_failed_commit():
    """A failed commit must not be followed by the scan cursor queued behind it: the cursor
    would close a version whose last shards no stored ledger names, and a restarted learner
    would never list them again."""
    writer, gate, order = Writer(), threading.Event(), []

    def failing_commit():
        gate.wait(5)
        raise OSError("disk full")

    try:
        writer.submit(failing_commit)
        writer.later(order.append, "cursor")  # queued while the commit is still in flight
        writer.later(order.append, "check")
        gate.set()
        with pytest.raises(OSError, match="disk full"):
            writer.wait()
        assert order == []
        writer.later(order.append, "after")  # the failure was raised: later work runs again
        writer.wait()
        assert order == ["after"]
    finally:
        writer.close()


def test_a_failed_commit_surfaces_while_the_learner_waits_for_data():
    """The learner waiting for data polls `check`: a commit that failed in the background
    (its child killed, the store gone) raises there, not only at the next step, which may
    never come while the workers wait at their cap for that commit."""
    writer, gate = Writer(), threading.Event()

    def failing_commit():
        gate.wait(5)
        raise RuntimeError("the commit process died")

    try:
        writer.submit(failing_commit)
        writer.check()  # still in flight: nothing to raise, and no wait
        gate.set()
        writer.pending[0].exception(timeout=5)
        with pytest.raises(RuntimeError, match="the commit process died"):
            writer.check()
        writer.check()  # raised once: nothing left
    finally:
        writer.close()


def test_the_learners_metrics_land_behind_their_commit_and_never_for_a_failed_one(tmp_path):
    """A step's figures flushed before its commit landed, by a learner stopped then, would be
    logged again by the restarted learner redoing that step: two sets for one version."""
    import time

    from shardrl.stages.context import MetricsSink
    from shardrl.store import LocalStore

    store = LocalStore(tmp_path)
    sink = MetricsSink(store, KEYS, "learn", 0)
    writer, gate = Writer(), threading.Event()
    sink.defer = writer.later

    def chunks() -> list[str]:
        return store.list(KEYS.root + "metrics/")

    def failing_commit():
        gate.wait(5)
        raise OSError("store down")

    try:
        writer.submit(lambda: gate.wait(5))  # version 1's commit, in flight
        sink.log(1, {"loss": 0.5})
        sink.flush()
        assert chunks() == []  # not before its commit
        gate.set()
        writer.wait()
        assert len(chunks()) == 1
        gate.clear()
        writer.submit(failing_commit)  # version 2's commit fails
        sink.log(2, {"loss": 0.4})
        sink.flush()
        gate.set()
        with pytest.raises(OSError):
            writer.wait()
        assert len(chunks()) == 1  # version 2's figures never landed
    finally:
        writer.close()

    # chunk names never go back, even when the clock does
    sink.defer = None
    ahead = time.time_ns() + 10 * 10**9
    for now in (ahead, ahead - 5 * 10**9):  # the clock steps back 5 s
        sink.log(3, {"loss": 0.3})
        original = time.time_ns
        time.time_ns = lambda now=now: now
        try:
            sink.flush()
        finally:
            time.time_ns = original
    names = chunks()
    assert names == sorted(names) and len(names) == 3
    assert names[1].endswith(f"{ahead // 1000}.parquet")
    assert names[2].endswith(f"{ahead // 1000 + 1}.parquet"), names


def test_a_restarted_writer_names_its_chunks_after_its_predecessors_on_a_clock_behind(tmp_path):
    """Readers resume each writer after the newest chunk they took: a restarted stage on a
    machine whose clock is behind the last one's would name its chunks below that mark, and
    no reader would ever take them."""
    import time

    from shardrl.doctor.series import ChunkTail
    from shardrl.stages.context import MetricsSink
    from shardrl.store import LocalStore

    store = LocalStore(tmp_path)
    ahead_us = time.time_ns() // 1000 + 3_600 * 10**6  # the first machine ran an hour ahead
    before = MetricsSink(store, KEYS, "learn", 0)
    before._last_key_us = ahead_us - 1
    before.log(1, {"loss": 0.5})
    before.flush()
    other = MetricsSink(store, KEYS, "learn", 1)  # another worker's newer chunk: not its own
    other._last_key_us = ahead_us + 10**9
    other.log(1, {"loss": 0.5})
    other.flush()
    tail = ChunkTail(store, KEYS)
    tail.take(tail.poll())

    after = MetricsSink(store, KEYS, "learn", 0)  # the restart, on the right clock
    after.log(2, {"loss": 0.4})
    after.flush()
    after.log(3, {"loss": 0.3})
    after.flush()
    new = tail.poll()
    assert [k.rpartition("/")[2] for k in new] == [f"{ahead_us + 1:016d}.parquet",
                                                   f"{ahead_us + 2:016d}.parquet"], new

    fresh = MetricsSink(store, KEYS, "score", 0)  # no predecessor: named by the clock
    fresh.log(1, {"x": 1.0})
    now_us = time.time_ns() // 1000
    fresh.flush()
    name = int(store.list(KEYS.root + "metrics/score/")[0].rpartition("/")[2][:-8])
    assert now_us <= name < ahead_us
