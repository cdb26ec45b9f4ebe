"""The learner's ready buffer: shards listed on the learner's thread, read on the reader
thread, buffered in listing order exactly once; the batching rule and the per-worker counts
on hand-built shards."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from shardrl.stages.learn.buffer import ReadyBuffer
from shardrl.stages.learn.profile import Profile
from shardrl.store import LocalStore, RunKeys
from shardrl.store.schemas import READY
from shardrl.store.shards import write_shard
from shardrl.store.watch import InotifyWatch

KEYS = RunKeys("r1")


def ready(groups: list[list[bool]], version: int = 0) -> pa.Table:
    """A ready shard: one group per entry, one row per flag (`keep`)."""
    rows: dict[str, list] = {f.name: [] for f in READY}
    for g, keeps in enumerate(groups):
        for i, keep in enumerate(keeps):
            values = {
                "prompt_id": f"p{g}", "group_id": f"g{g}", "sample_idx": i,
                "policy_version": version, "worker": 0, "prompt_text": "x",
                "prompt_token_ids": [3, 4], "response_token_ids": [5], "behavior_logprobs": [-1.0],
                "finish_reason": "stop", "response_text": "y", "answer": "y", "category": "c",
                "created_at": 0.0, "reward_verifier": float(i % 2), "reward_model": None,
                "reward_rm": float(i % 2), "correct": bool(i % 2), "reward_error": None,
                "ref_logprobs": [-1.0], "reward_total": float(i % 2), "advantage": 0.0,
                "keep": keep, "filter_reason": None if keep else "zero_variance",
            }
            for name, value in values.items():
                rows[name].append(value)
    return pa.table(rows, schema=READY)


class ListedScanner:
    """A scanner that returns the keys it was given, minus those already committed."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.committed: set[str] = set()
        self.low = 0
        self.rollout_workers = 2

    def poll(self, newest: int) -> list[str]:
        return [k for k in self.keys if k not in self.committed]


class GatedStore(LocalStore):
    """A folder store whose shard reads wait until `gate` is set."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()

    def get_bytes(self, key: str) -> bytes:
        if key.endswith(".parquet"):
            assert self.gate.wait(10)
        return super().get_bytes(key)


def make_buffer(tmp_path):
    store = GatedStore(tmp_path)
    ctx = SimpleNamespace(store=store, keys=KEYS, log=logging.getLogger("test"))
    scanner = ListedScanner()
    return store, scanner, ReadyBuffer(ctx, scanner, Profile())


def put(store, scanner, worker: int, seq: int, table: pa.Table, version: int = 0) -> str:
    key = KEYS.shard("ready", version, worker, seq)
    write_shard(store, key, table, READY)
    scanner.keys.append(key)
    return key


def test_reads_buffer_in_listing_order_once_each_and_counts_kept_groups(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    # worker 0: 2 groups, one kept; worker 1: 3 groups, two kept (a group with one kept
    # row counts as kept)
    a = put(store, scanner, 0, 0, ready([[True, True], [False, False]]))
    b = put(store, scanner, 1, 0, ready([[True, False], [False, False], [True, True]]))
    try:
        assert buffer.poll(0, block=True)
        assert [k for k, _ in buffer.items] == [a, b]
        counts = buffer.counts()
        assert counts.groups_by_worker == {0: 2, 1: 3}
        assert counts.kept_groups_by_worker == {0: 1, 1: 2}
        # polled again: nothing new, nothing buffered twice
        assert not buffer.poll(0, block=True)
        assert [k for k, _ in buffer.items] == [a, b]
        # 3 kept groups in the buffer: a batch of 2 takes both shards (the first has 1)
        batch = buffer.next_batch(0, k=8, batch_prompts=2)
        assert [key for key, _, outcome in batch] == [a, b]
        assert buffer.next_batch(0, k=8, batch_prompts=4) is None
        buffer.remove(batch[:1])
        scanner.committed.add(a)
        assert buffer.counts().groups_by_worker == {1: 3}
    finally:
        buffer.close()


def test_many_filtered_groups_of_one_worker_make_a_step(tmp_path):
    # B=4 from 2 workers (share 2, so 16 groups of one worker step anyway): worker 0 wrote
    # 2 kept groups, worker 1 one kept among 15 filtered ones
    store, scanner, buffer = make_buffer(tmp_path)
    a = put(store, scanner, 0, 0, ready([[True, False], [True, False]]))
    b = put(store, scanner, 1, 0, ready([[False, False]] * 15))
    try:
        buffer.poll(0, block=True)
        assert buffer.next_batch(0, k=8, batch_prompts=4) is None  # 2 kept, 15 from worker 1
        c = put(store, scanner, 1, 1, ready([[True, False]]))
        buffer.poll(0, block=True)
        assert [key for key, _, _ in buffer.next_batch(0, k=8, batch_prompts=4)] == [a, b, c]
        # the whole buffer's groups (19) are still short of 8 batches (32)
        buffer.scanner.rollout_workers = 1
        assert buffer.next_batch(0, k=8, batch_prompts=4) is None
    finally:
        buffer.close()


def test_a_shard_still_being_read_is_not_listed_again_nor_buffered_early(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    store.gate.clear()  # reads wait
    a = put(store, scanner, 0, 0, ready([[True, False]]))
    try:
        assert not buffer.poll(0)  # listed, read not finished: nothing buffered yet
        assert buffer.reading() and buffer.items == []
        b = put(store, scanner, 0, 1, ready([[True, False]]))
        assert not buffer.poll(0)  # a is not submitted twice; b queues behind it
        assert [k for k, _, _ in buffer.reads] == [a, b]
        store.gate.set()
        assert buffer.collect(block=True)
        assert [k for k, _ in buffer.items] == [a, b] and not buffer.reading()
    finally:
        buffer.close()


def test_an_unreadable_shard_is_quarantined_and_skipped_in_place(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    a = put(store, scanner, 0, 0, ready([[True, False]]))
    bad = KEYS.shard("ready", 0, 0, 1)
    store.put_bytes(bad, b"not parquet")
    scanner.keys.append(bad)
    c = put(store, scanner, 0, 2, ready([[True, True]]))
    try:
        assert buffer.poll(0, block=True)
        assert [k for k, _ in buffer.items] == [a, c]
        assert not store.exists(bad)
        assert store.list(KEYS.quarantine("learn", KEYS.version_prefix("ready", 0)))
    finally:
        buffer.close()


def test_hand_off_latency_is_counted_only_for_shards_listed_while_waiting(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    put(store, scanner, 0, 0, ready([[True, False]]))
    try:
        buffer.poll(0, block=True)
        assert buffer.profile.hops == []
        buffer.waiting = True  # as after `wait`
        put(store, scanner, 0, 1, ready([[True, False]]))
        buffer.poll(0, block=True)
        assert len(buffer.profile.hops) == 1 and buffer.profile.hops[0] > 0  # created_at 0
        assert np.isfinite(buffer.profile.read_s)
    finally:
        buffer.close()


def test_between_steps_the_store_is_listed_only_when_a_commit_was_reported(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    listed = []
    poll = scanner.poll
    scanner.poll = lambda newest: listed.append(newest) or poll(newest)
    a = put(store, scanner, 0, 0, ready([[True, False]]))
    try:
        buffer.poll(0, block=True)  # the first poll lists
        assert len(listed) == 1 and [k for k, _ in buffer.items] == [a]
        buffer.poll(0, block=True)  # lists again if the watch reported a's commit
        n = len(listed)
        buffer.poll(0, block=True)
        if isinstance(buffer.arrivals, InotifyWatch):  # nothing new reported: no listing
            assert len(listed) == n
        b = put(store, scanner, 0, 1, ready([[True, False]]))
        buffer.poll(0, block=True)  # a commit was reported (or the watch polls): listed
        assert [k for k, _ in buffer.items] == [a, b]
        buffer.wait(0.01)  # after any wait the next poll lists, whatever the watch saw
        n = len(listed)
        buffer.poll(0, block=True)
        assert len(listed) == n + 1
    finally:
        buffer.close()


def test_collecting_the_first_read_does_not_wait_for_the_ones_behind_it(tmp_path):
    store, scanner, buffer = make_buffer(tmp_path)
    listed, held = threading.Event(), threading.Event()
    plain_get = store.get_bytes

    def get_bytes(key: str) -> bytes:  # the first read waits for `listed`, the second for `held`
        assert (held if key.endswith("000001.parquet") else listed).wait(10)
        return plain_get(key)

    store.get_bytes = get_bytes
    a = put(store, scanner, 0, 0, ready([[True, False], [True, False]]))
    b = put(store, scanner, 0, 1, ready([[True, False]]))
    try:
        buffer.poll(0)  # both reads start; neither can end before poll collects what is done
        assert not buffer.items and buffer.reading()
        listed.set()
        assert buffer.collect(block=False, first=True)  # a is in, b still being read
        assert [k for k, _ in buffer.items] == [a] and buffer.reading()
        assert [key for key, _, _ in buffer.next_batch(0, k=8, batch_prompts=2)] == [a]
        held.set()
        assert buffer.collect(block=False, first=True)
        assert [k for k, _ in buffer.items] == [a, b] and not buffer.reading()
    finally:
        listed.set()
        held.set()
        buffer.close()


def test_tally_counts_groups_and_groups_with_a_kept_row():
    from shardrl.stages.learn.buffer import tally

    key = KEYS.shard("ready", 3, 1, 7)
    # g0: two rows kept, g1: none, g2: one of three, g3: none
    table = ready([[True, True], [False, False], [False, True, False], [False]], version=3)
    assert tally(key, table) == (1, 4, 2)
    assert tally(key, ready([[False, False], [False]], version=3)) == (1, 2, 0)
