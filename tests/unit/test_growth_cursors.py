"""Polls that cost the same late in a run as early on: metric chunks after per-writer marks,
evaluation from a cursor, the runner's tick, the rollout backlog."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest

from shardrl.config import RunConfig
from shardrl.doctor.series import ChunkReader, ChunkTail
from shardrl.orchestrate.monitor import Monitor
from shardrl.stages.evaluate import Schedule, next_wanted
from shardrl.stages.rollout import backlog
from shardrl.store import LocalStore, RunKeys, write_shard
from shardrl.store.keys import METRICS_BUCKET_US, metrics_writer
from shardrl.store.records import Buffered, Progress
from shardrl.store.schemas import METRICS

KEYS = RunKeys("r1")
T0 = 1_712_000_000_000_000  # microseconds: a bucket boundary (1_712_000 * METRICS_BUCKET_US)


class CountingStore(LocalStore):
    """A folder store that counts listings and the keys they return."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.listings = 0
        self.listed: list[str] = []

    def list(self, prefix: str = "", start_after: str | None = None,
             limit: int | None = None) -> list[str]:
        keys = super().list(prefix, start_after, limit)
        self.listings += 1
        self.listed += keys
        return keys


def chunk(store, key: str, step: int, value: float = 1.0) -> str:
    """A one-point metrics chunk at `key`."""
    table = pa.table({"stage": ["s"], "name": ["s/x"], "step": [step], "value": [value],
                      "time": [0.0]})
    write_shard(store, key, table, METRICS)
    return key


def flat(stage: str, worker: int, i: int) -> str:
    """A chunk key as MetricsSink names it today: metrics/<stage>/wWW-<time>.parquet."""
    return KEYS.metrics(stage, f"w{worker:02d}-{T0 + i:016d}")


def test_chunk_keys_name_their_writer_in_both_layouts():
    bucketed = KEYS.metrics_chunk("rollout", 3, T0 + 5 * METRICS_BUCKET_US + 7)
    # 1_712_000_000_000_000 // 10**9 = 1_712_000, then 5 buckets further
    assert bucketed == "runs/r1/metrics/rollout/w03/1712005/1712005000000007.parquet"
    assert metrics_writer(bucketed) == "rollout/w03"
    assert metrics_writer(flat("learn", 0, 1)) == "learn/w00"
    assert metrics_writer(KEYS.metrics("learner", "steps")) == "learner/steps"
    with pytest.raises(ValueError):
        metrics_writer("runs/r1/eval/v000001.json")
    with pytest.raises(ValueError):
        KEYS.metrics_chunk("learn", 100, T0)


def write_history(store, writers: list[tuple[str, int]], count: int) -> list[str]:
    return [chunk(store, flat(stage, w, i), i) for stage, w in writers for i in range(count)]


@pytest.mark.parametrize("history", [20, 400])
def test_a_poll_lists_as_many_keys_whatever_the_history(tmp_path, history):
    store = CountingStore(tmp_path)
    writers = [("learn", 0), ("rollout", 0), ("rollout", 1)]
    old = write_history(store, writers, history)
    tail = ChunkTail(store, KEYS)
    assert tail.poll() == sorted(old)
    tail.take(old)
    new = [chunk(store, flat(stage, w, history), history) for stage, w in writers]
    store.listings, store.listed = 0, []
    assert tail.poll() == new
    # Pages of FIRST_PAGE = 16 keys: from the start, 16 keys of learn/w00 (its first is
    # taken: jump to its mark); after it, its new chunk + 15 of rollout/w00 (jump); its new
    # chunk + 15 of rollout/w01 (jump); its new chunk alone, a short page: the end.
    # 4 listings, 16 + 16 + 16 + 1 = 49 keys, for a history of 20 as of 400.
    assert store.listings == 4 and len(store.listed) == 49
    tail.take(new)
    assert tail.poll() == []


def test_every_chunk_is_returned_once_across_polls_backlogs_and_layouts(tmp_path):
    store = LocalStore(tmp_path)
    tail = ChunkTail(store, KEYS)
    written, seen = [], []
    # a backlog of 100 chunks of one writer takes pages of 16, 64 and 256 keys
    written += write_history(store, [("score", 0)], 100)
    seen += tail.poll()
    tail.take(seen)
    # a writer appears later; an older one goes on, then switches to bucketed chunks
    written += [chunk(store, flat("evaluate", 0, 1), 1), chunk(store, flat("score", 0, 100), 1)]
    written += [chunk(store, KEYS.metrics_chunk("score", 0, T0 + b * METRICS_BUCKET_US), b)
                for b in (101, 102)]
    new = tail.poll()
    tail.take(new)
    seen += new
    assert tail.poll() == []
    assert sorted(seen) == sorted(written) and len(seen) == len(set(seen)) == 104


def test_the_reader_accumulates_the_points_of_new_chunks_only(tmp_path):
    store = LocalStore(tmp_path)
    reader = ChunkReader(store, KEYS)
    chunk(store, flat("learn", 0, 1), 1, 2.0)
    assert reader.poll() == 1
    chunk(store, flat("learn", 0, 2), 2, 4.0)
    chunk(store, flat("rollout", 0, 2), 2, 1.0)
    assert reader.poll() == 2 and reader.poll() == 0
    # step 1: 2.0; step 2: the mean of 4.0 (learn) and 1.0 (rollout), read in one poll
    assert reader.metrics().get("s/x").values.tolist() == [2.0, 2.5]
    chunk(store, flat("rollout", 0, 3), 2, 7.0)  # a later chunk at an earlier step
    assert reader.poll() == 1
    assert reader.metrics().get("s/x").values.tolist() == [2.0, 4.0]  # (4 + 1 + 7) / 3


class RecordingClient:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def log_batch(self, run_id, metrics):  # noqa: ARG002 - MlflowClient's signature
        self.batches.append(metrics)


def monitor(store) -> Monitor:
    cfg = RunConfig.model_validate({"tracking": {"enabled": False}, "rollout": {"workers": 1}})
    lr = SimpleNamespace(cfg=cfg, store=store, keys=KEYS, run_id="r1")
    m = Monitor(lr, progress_bar=False)
    m.client, m.mlflow = RecordingClient(), "mlflow-run"
    return m


def test_the_forwarder_sends_each_step_once_and_a_restart_resumes_from_its_marks(tmp_path):
    store = CountingStore(tmp_path)
    old = write_history(store, [("learn", 0), ("rollout", 0)], 30)
    first = monitor(store)
    first._forward()
    # each writer's newest step (29) waits: a later chunk could still add to it
    assert sorted(m.step for b in first.client.batches for m in b) == sorted(2 * list(range(29)))
    new = chunk(store, flat("rollout", 0, 30), 30)
    second = monitor(store)  # the runner was restarted: its marks come from the store
    store.listed = []
    second._forward()
    second._forward()
    # rollout's step 29 is settled by its step 30; learn's 29 still waits
    assert [[(m.key, m.step) for m in b] for b in second.client.batches] == [[("s/x", 29)]]
    # what the two polls listed: at most a page of each writer's oldest chunks and its open
    # one (step 29, read again after the restart), never all
    assert new in store.listed and len(set(store.listed) & set(old)) <= 2 * (16 + 1)
    second._forward(final=True)
    assert [m.step for m in second.client.batches[-1]] == [29, 30]


def test_the_tick_reads_the_newest_evaluation_once(tmp_path):
    store = CountingStore(tmp_path)
    m = monitor(store)
    assert m._last_eval() is None
    store.put_json(KEYS.eval_summary(10), {"pass_at_1": 0.5})
    store.put_json(KEYS.eval_latest(), {"version": 10})
    assert m._last_eval() == (10, {"pass_at_1": 0.5})
    store.put_json(KEYS.eval_summary(10), {"pass_at_1": 0.0})  # not read again
    assert m._last_eval() == (10, {"pass_at_1": 0.5}) and store.listings == 0


def test_next_wanted_version():
    # every 10 of 25 steps: 0, 10, 20, then the last one, 25
    assert [next_wanted(v, 10, 25) for v in (0, 7, 10, 20, 24, 25)] == [10, 10, 20, 25, 25, None]


def test_the_schedule_owes_the_lowest_unevaluated_version_without_listing(tmp_path):
    store = CountingStore(tmp_path)
    for v in (0, 20):  # an older run evaluated 0 and 20, not 10
        store.put_json(KEYS.eval_summary(v), {"version": v})
    s = Schedule(store, KEYS, every=10, total=25)
    listings = store.listings
    assert s.due(9) is None and s.due(10) == 10
    s.advance()  # 10 done; 20 was done: 25 is owed next
    assert s.due(24) is None and s.due(25) == 25
    s.advance()
    assert s.next is None and s.due(10_000) is None
    assert store.listings == listings == 1


@pytest.mark.parametrize(("evaluated", "final", "owed"), [
    ((0,), 17, [10, 17]),     # ends past the next owed version: 10, then 17 as the last
    ((0, 10), 17, [17]),      # next owed was 20: 17 becomes the last, owed at once
    ((0, 10), 20, [20]),      # 20 is the last either way
    ((0, 10, 20), 20, []),    # already evaluated: nothing more is owed
    ((0,), 0, []),            # converged at the snapshot, which is evaluated
    ((0,), 100, [10, 20, 25]),  # at or past `total`: the schedule is unchanged
])
def test_a_learner_that_converged_early_ends_the_schedule_at_its_last_version(
        tmp_path, evaluated, final, owed):
    store = LocalStore(tmp_path)
    for v in evaluated:
        store.put_json(KEYS.eval_summary(v), {"version": v})
    s = Schedule(store, KEYS, every=10, total=25)
    s.end_at(final)
    got = []
    while (v := s.due(10_000)) is not None:
        got.append(v)
        s.advance()
    assert got == owed


def test_backlog_counts_kept_groups_the_learner_has_not_committed():
    progress = Progress.model_validate({"groups_by_worker": {"1": 40},
                                        "kept_groups_by_worker": {"1": 10}})
    # worker 1 wrote 16 kept groups (exact, inline post-processing): 16 - 10 committed
    assert backlog(progress, 1, 64, 16) == 6
    assert backlog(progress, 1, 64, 5) == 0  # never negative
    # unknown keep counts: 64 groups written, 40 committed (10 kept), nothing buffered:
    # the 24 on their way count at the rate seen so far, 1/4
    assert backlog(progress, 1, 64, None) == 24 * 0.25
    # 8 more read by the learner, 6 of them kept: 6 + 16 on their way at 16/48
    buffered = Buffered(groups_by_worker={1: 8}, kept_groups_by_worker={1: 6})
    assert backlog(progress, 1, 64, None, buffered) == 6 + 16 * (16 / 48)
    assert backlog(progress, 0, 3, None) == 3  # nothing of worker 0 seen yet: rate 1
    # the learner holds all of worker 0's groups, none kept: nothing waits (no deadlock
    # while the learner gathers enough kept groups)
    assert backlog(Progress(), 0, 12, None, Buffered(groups_by_worker={0: 12},
                                                     kept_groups_by_worker={0: 0})) == 0
