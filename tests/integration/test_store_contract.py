"""One contract for every Store backend: a folder and S3 on a real SeaweedFS server."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shardrl.store import (
    LocalStore,
    NotFound,
    PermanentStoreError,
    RetryPolicy,
    RunKeys,
    Store,
    StoreError,
    list_column_to_padded,
    open_store,
    read_or_quarantine,
    read_shard,
    write_shard,
)
from shardrl.store.schemas import ROLLOUT, SCORED

BUCKET = "shardrl-contract"
FAST_RETRY = RetryPolicy(max_attempts=100, base_delay_s=0.05, max_delay_s=0.5, deadline_s=60.0)
Spec = tuple[str, dict[str, Any]]


def _open(spec: Spec) -> Store:
    """Build the store a spec describes (also in spawned child processes)."""
    kind, kwargs = spec
    if kind == "local":
        return LocalStore(**kwargs)
    from shardrl.store.s3 import S3Store  # the minio SDK only where needed: it imports slowly

    return S3Store(**kwargs, retry=FAST_RETRY)


@pytest.fixture(scope="module")
def bucket(seaweed) -> str:
    seaweed.make_bucket(BUCKET)
    return BUCKET


@pytest.fixture(params=["local", "s3"])
def spec(request, tmp_path) -> Spec:
    if request.param == "local":
        return ("local", {"root": str(tmp_path / "store")})
    server = request.getfixturevalue("seaweed")
    return ("s3", {
        "bucket": request.getfixturevalue("bucket"), "prefix": f"t-{uuid.uuid4().hex[:12]}",
        "endpoint": server.endpoint, "access_key": server.access_key,
        "secret_key": server.secret_key,
    })


@pytest.fixture
def store(spec) -> Store:
    return _open(spec)


def _rollout_table(rows: int) -> pa.Table:
    """`rows` rollout rows: row i has i+1 response tokens [10, 11, ...] and logprobs -0.5."""
    return pa.table({
        "prompt_id": [f"p{i // 2}" for i in range(rows)],
        "group_id": [f"g{i // 2}" for i in range(rows)],
        "sample_idx": pa.array([i % 2 for i in range(rows)], pa.int32()),
        "policy_version": pa.array([3] * rows, pa.int64()),
        "worker": pa.array([0] * rows, pa.int32()),
        "prompt_text": ["2+2="] * rows,
        "prompt_token_ids": pa.array([[1, 2, 3]] * rows, pa.list_(pa.int32())),
        "response_token_ids": pa.array(
            [list(range(10, 11 + i)) for i in range(rows)], pa.list_(pa.int32())
        ),
        "behavior_logprobs": pa.array([[-0.5] * (i + 1) for i in range(rows)], pa.list_(pa.float32())),
        "finish_reason": ["stop"] * rows,
        "response_text": ["4"] * rows,
        "answer": ["4"] * rows,
        "category": ["add"] * rows,
        "created_at": [1.7e9] * rows,
    }, schema=ROLLOUT)


def test_bytes_and_json_round_trip(store):
    every_byte = bytes(range(256))
    store.put_bytes("a/bin", every_byte)
    store.put_bytes("a/empty", b"")
    assert store.get_bytes("a/bin") == every_byte
    assert store.get_bytes("a/empty") == b""
    store.put_bytes("a/bin", b"rewritten")  # re-processing after a crash rewrites the same key
    assert store.get_bytes("a/bin") == b"rewritten"
    obj = {"version": 12, "files": ["model.safetensors"], "nested": {"x": 1.5, "ok": True}}
    store.put_json("policy/LATEST.json", obj)
    assert store.get_json("policy/LATEST.json") == obj
    with pytest.raises(ValueError):
        store.put_json("bad.json", {"x": float("nan")})  # strict JSON only
    with pytest.raises(StoreError, match="not valid JSON"):
        store.get_json("a/bin")


def test_put_if_absent_writes_only_the_first(store):
    assert store.put_if_absent("marks/ABORTED.json", b"first") is True
    assert store.put_if_absent("marks/ABORTED.json", b"second") is False
    assert store.get_bytes("marks/ABORTED.json") == b"first"
    assert store.list("marks/") == ["marks/ABORTED.json"]


def test_put_if_absent_lets_one_of_racing_writers_win(spec):
    """Eight writers at once, each with its own client, five keys in turn: exactly one creates
    each key, and the object holds what the winner wrote."""
    writers = 8
    stores = [_open(spec) for _ in range(writers)]
    def write(i: int, key: str, start: threading.Barrier) -> bool:
        start.wait()
        return stores[i].put_if_absent(key, f"writer {i}".encode())

    for round_ in range(5):
        key = f"marks/race-{round_}.json"
        start = threading.Barrier(writers)
        with ThreadPoolExecutor(writers) as pool:
            won = list(pool.map(write, range(writers), [key] * writers, [start] * writers))
        assert won.count(True) == 1, won
        assert stores[0].get_bytes(key) == f"writer {won.index(True)}".encode()


def test_a_range_of_an_object(store):
    data = bytes(range(256)) * 4
    store.put_bytes("r/obj", data)
    assert store.get_range("r/obj", 0, 8) == data[:8]
    assert store.get_range("r/obj", 300, 100) == data[300:400]
    assert store.get_range("r/obj", 1000, 100) == data[1000:]  # fewer at its end
    assert store.get_range("r/obj", 1024, 5) == b""  # none from past it
    assert store.get_range("r/obj", 5000, 5) == b""
    assert store.get_range("r/obj", 0, 10**13) == data  # no buffer the size asked for
    store.put_bytes("r/empty", b"")
    assert store.get_range("r/empty", 0, 5) == b""
    with pytest.raises(NotFound):
        store.get_range("r/missing", 0, 1)
    for offset, length in ((-1, 1), (0, 0), (0, -2), (True, 1), (0.5, 1)):
        with pytest.raises(ValueError):
            store.get_range("r/obj", offset, length)


def test_missing_keys_exists_and_delete(store):
    with pytest.raises(NotFound):
        store.get_bytes("nope/missing")
    assert not store.exists("nope/missing")
    store.delete("nope/missing")  # deleting a missing key is not an error
    store.put_bytes("d/k", b"1")
    assert store.exists("d/k")
    assert not store.exists("d") and not store.exists("d/k/x")  # a key's folder is no key
    with pytest.raises(NotFound):
        store.get_bytes("d")
    store.delete("d")
    store.delete("d/k/x")
    assert store.list() == ["d/k"]
    store.delete("d/k")
    assert not store.exists("d/k") and store.list() == []
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"1")


def test_listing_order_prefixes_and_start_after(store):
    keys = ["b/2", "a/b0", "a/b/c", "a/b.json", "a/a", "c", "a/b/d/e", "b/10"]
    for key in keys:
        store.put_bytes(key, key.encode())
    # Byte order: '.' (0x2e) < '/' (0x2f) < '0' (0x30), so a/b.json < a/b/... < a/b0.
    everything = ["a/a", "a/b.json", "a/b/c", "a/b/d/e", "a/b0", "b/10", "b/2", "c"]
    assert store.list() == everything
    assert store.list("a/b") == ["a/b.json", "a/b/c", "a/b/d/e", "a/b0"]
    assert store.list("a/b/") == ["a/b/c", "a/b/d/e"]
    assert store.list("b/") == ["b/10", "b/2"]
    assert store.list("zzz/") == []
    assert store.list(start_after="a/b/c") == ["a/b/d/e", "a/b0", "b/10", "b/2", "c"]
    assert store.list("a/", start_after="a/b/") == ["a/b/c", "a/b/d/e", "a/b0"]  # not a key
    assert store.list("a/", start_after="a/b0") == []
    # Paging with the last key seen as cursor returns each key exactly once.
    seen, cursor = [], None
    while True:
        page = store.list(start_after=cursor)[:3]
        if not page:
            break
        seen += page
        cursor = page[-1]
    assert seen == everything


def test_listing_with_a_limit_stops_early_and_resumes_inside_folders(store):
    # No folder shares its name with a sibling that extends it by a character below '/'
    # (a/b/ beside a/b.json): SeaweedFS lists such a folder first, out of byte order.
    keys = ["b/2", "a/b0", "a/b/c", "a/a", "c", "a/b/d/e", "b/10"]
    for key in keys:
        store.put_bytes(key, key.encode())
    # byte order: a/a < a/b/c < a/b/d/e < a/b0 < b/10 < b/2 < c
    assert store.list(limit=1) == ["a/a"]
    assert store.list(limit=3) == ["a/a", "a/b/c", "a/b/d/e"]
    assert store.list(limit=100) == store.list() == sorted(keys)
    assert store.list("a/b", limit=3) == ["a/b/c", "a/b/d/e", "a/b0"]
    assert store.list("a/b/", limit=5) == ["a/b/c", "a/b/d/e"]
    # resuming after a key continues into the next folder, or out of the folder it is in
    # (start_after is a key seen before: SeaweedFS skips a folder named by start_after)
    assert store.list(start_after="a/b/c", limit=1) == ["a/b/d/e"]
    assert store.list(start_after="a/b/c", limit=2) == ["a/b/d/e", "a/b0"]
    assert store.list("a/", start_after="a/b/d/e", limit=3) == ["a/b0"]
    assert store.list("b/", start_after="a/zzz", limit=1) == ["b/10"]
    assert store.list("a/", start_after="b/", limit=1) == []
    # hopping one key at a time visits every key once, in order
    seen, cursor = [], None
    while page := store.list(start_after=cursor, limit=1):
        seen += page
        cursor = page[-1]
    assert seen == sorted(keys)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            store.list(limit=bad)


def test_listing_resumes_after_a_key_that_was_never_written(store):
    """A metrics writer looks for chunks named after the clock's time: a key that may not
    exist, inside a folder that may not exist either."""
    keys = ["m/w/1/10", "m/w/1/30", "m/w/3/50", "m/x/1/60"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert store.list("m/w/", start_after="m/w/1/20") == ["m/w/1/30", "m/w/3/50"]
    assert store.list("m/w/", start_after="m/w/2/40", limit=1) == ["m/w/3/50"]
    assert store.list("m/w/", start_after="m/w/3/55") == []


def test_shard_round_trip_and_padding(store):
    key = RunKeys("r1").rollout(3, 0, 7)
    table = _rollout_table(4)
    write_shard(store, key, table, ROLLOUT)
    back = read_shard(store, key, ROLLOUT)
    assert back.equals(table)
    tokens, lengths = list_column_to_padded(back, "response_token_ids", pad=-1)
    # Row i holds 10..10+i, so lengths are 1..4 and the matrix is 4 x 4 padded with -1.
    assert lengths.tolist() == [1, 2, 3, 4]
    assert tokens.tolist() == [
        [10, -1, -1, -1], [10, 11, -1, -1], [10, 11, 12, -1], [10, 11, 12, 13],
    ]
    assert store.list("runs/r1/") == [key]


def _write_keys(spec: Spec, worker: int, count: int) -> None:
    store = _open(spec)
    for i in range(count):
        store.put_bytes(f"w{worker}/k{i:03d}", f"{worker}:{i};".encode() * 100)


def test_processes_write_distinct_keys_at_once(spec, store):
    workers, count = 3, 15
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_keys, args=(spec, w, count)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * workers
    expected = sorted(f"w{w}/k{i:03d}" for w in range(workers) for i in range(count))
    assert store.list() == expected
    for w, i in [(0, 0), (1, 7), (workers - 1, count - 1)]:
        assert store.get_bytes(f"w{w}/k{i:03d}") == f"{w}:{i};".encode() * 100


def _large(index: int, size: int) -> bytes:
    return np.random.default_rng(index).bytes(size)


def _write_large(spec: Spec, count: int, size: int) -> None:
    store = _open(spec)
    for i in range(count):
        store.put_bytes(f"big/{i}", _large(i, size))


def test_reader_never_sees_a_partial_object(spec, store):
    count, size = 3, 30 * 2**20
    digests = {f"big/{i}": hashlib.sha256(_large(i, size)).digest() for i in range(count)}
    writer = multiprocessing.get_context("spawn").Process(
        target=_write_large, args=(spec, count, size)
    )
    writer.start()
    verified, polls_before_done = set(), 0
    deadline = time.monotonic() + 120
    while len(verified) < count and time.monotonic() < deadline:
        polls_before_done += 1
        for key in store.list("big/"):
            if key not in verified:
                data = store.get_bytes(key)  # listed => complete
                assert len(data) == size and hashlib.sha256(data).digest() == digests[key]
                verified.add(key)
        time.sleep(0.02)
    writer.join(60)
    assert writer.exitcode == 0 and verified == set(digests)
    assert polls_before_done > count  # the reader really polled while the writer wrote


def test_corrupt_and_wrong_schema_shards_are_quarantined(store):
    rk = RunKeys("r1")
    corrupt, wrong, good = rk.rollout(1, 0, 0), rk.rollout(1, 0, 1), rk.rollout(1, 0, 2)
    store.put_bytes(corrupt, b"PAR1 this is not parquet")
    scored = _rollout_table(2).append_column(
        "reward_rm", pa.array([1.0, 0.0], pa.float32())
    )  # a column the rollout schema does not have
    write_shard(store, wrong, scored, scored.schema)
    write_shard(store, good, _rollout_table(2), ROLLOUT)

    assert read_or_quarantine(store, corrupt, ROLLOUT, "score") is None
    assert read_or_quarantine(store, wrong, ROLLOUT, "score") is None
    assert read_or_quarantine(store, good, ROLLOUT, "score").num_rows == 2

    assert store.list(rk.kind_prefix("rollouts")) == [good]
    q_corrupt = "runs/r1/quarantine/score/rollouts/v000001/w00-000000.parquet"
    q_wrong = "runs/r1/quarantine/score/rollouts/v000001/w00-000001.parquet"
    assert store.list(rk.root + "quarantine/") == [
        q_corrupt, q_corrupt + ".error.json", q_wrong, q_wrong + ".error.json",
    ]
    assert store.get_bytes(q_corrupt) == b"PAR1 this is not parquet"
    error = store.get_json(q_corrupt + ".error.json")
    assert error["error_type"] == "CorruptShard" and error["stage"] == "score"
    assert error["original_key"] == corrupt and error["size_bytes"] == 24
    assert "not a readable Parquet file" in error["message"]
    error = store.get_json(q_wrong + ".error.json")
    assert error["error_type"] == "SchemaError" and "unexpected ['reward_rm']" in error["message"]
    with pytest.raises(Exception, match="missing"):
        read_shard(store, good, SCORED)  # read directly, a violation raises


def _s3(server, bucket: str, **overrides) -> Store:
    kwargs = {"bucket": bucket, "prefix": "creds", "endpoint": server.endpoint,
              "access_key": server.access_key, "secret_key": server.secret_key} | overrides
    return _open(("s3", kwargs))


def test_put_if_absent_falls_back_to_a_plain_put_where_conditions_are_not_implemented(
        seaweed, bucket, monkeypatch):
    """A server that answers NotImplemented to `If-None-Match` still gets the object."""
    import urllib3
    from minio.error import S3Error

    store = _s3(seaweed, bucket, prefix=f"t-{uuid.uuid4().hex[:12]}")

    put = store._client._put_object

    def refuse(bucket_name, object_name, data, headers=None, query_params=None):
        if headers and "If-None-Match" in headers:
            raise S3Error(urllib3.HTTPResponse(status=501), "NotImplemented", "no conditions",
                          "/k", None, None)
        return put(bucket_name, object_name, data, headers, query_params)

    monkeypatch.setattr(store._client, "_put_object", refuse)
    assert store.put_if_absent("marks/ABORTED.json", b"first") is True
    assert store.put_if_absent("marks/ABORTED.json", b"second") is False
    assert store.get_bytes("marks/ABORTED.json") == b"first"


@pytest.mark.parametrize("overrides", [
    {"secret_key": "wrong-secret-123"}, {"access_key": "unknown-key", "secret_key": "x" * 16},
])
def test_bad_credentials_fail_at_once(seaweed, bucket, overrides):
    store = _s3(seaweed, bucket, **overrides)
    start = time.monotonic()
    with pytest.raises(PermanentStoreError) as info:
        store.put_bytes("k", b"1")
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert seaweed.endpoint in message and repr(bucket) in message
    assert overrides["secret_key"] not in message + repr(store)


def test_missing_bucket_fails_at_once(seaweed, bucket):
    store = _s3(seaweed, "no-such-bucket-here")
    start = time.monotonic()
    with pytest.raises(PermanentStoreError, match="does not exist") as info:
        store.get_bytes("k")
    assert time.monotonic() - start < 5
    assert seaweed.endpoint in str(info.value) and "'no-such-bucket-here'" in str(info.value)


def test_open_store_takes_credentials_from_the_environment(seaweed, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ignored-because-shardrl-wins")
    monkeypatch.setenv("SHARDRL_AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    monkeypatch.setenv("S3_ENDPOINT_URL", seaweed.endpoint)
    store = open_store(f"s3://{bucket}/env-{uuid.uuid4().hex[:8]}")
    store.put_json("x.json", {"a": 1})
    assert store.get_json("x.json") == {"a": 1}


def test_transient_outage_is_survived_and_logged_once(seaweed, bucket, caplog):
    store = _s3(seaweed, bucket, prefix=f"outage-{uuid.uuid4().hex[:8]}")
    store.put_bytes("before", b"kept")
    stopped = threading.Event()

    def outage() -> None:
        seaweed.stop()
        stopped.set()
        time.sleep(3)
        seaweed.start()

    thread = threading.Thread(target=outage)
    thread.start()
    assert stopped.wait(30)
    payload = b"written during the outage" * 1000
    with caplog.at_level(logging.WARNING, logger="shardrl.store"):
        with ThreadPoolExecutor(2) as pool:  # a put and a get retried at the same time
            put = pool.submit(store.put_bytes, "during", payload)
            get = pool.submit(store.get_bytes, "before")
            put.result(90)
            assert get.result(90) == b"kept"
    thread.join(60)
    assert store.get_bytes("during") == payload
    messages = [r.getMessage() for r in caplog.records if r.name == "shardrl.store"]
    assert len(messages) == 2, messages  # one when the outage starts, one when it ends
    assert "unavailable" in messages[0] and "available again" in messages[1]


def test_a_large_object_is_sent_as_one_put(seaweed, bucket):
    # 12 MiB is above the SDK's 5 MiB default part size; a multipart upload would leave an
    # ETag ending in "-<parts>", a single PUT the plain MD5 of the content.
    store = _s3(seaweed, bucket, prefix=f"one-put-{uuid.uuid4().hex[:8]}")
    data = _large(7, 12 * 2**20)
    store.put_bytes("big", data)
    etag = seaweed.client().stat_object(bucket, f"{store.prefix}big").etag
    assert etag.strip('"') == hashlib.md5(data).hexdigest()


def test_writer_and_put_file_round_trip(store, tmp_path):
    data = _large(3, 3 * 2**20 + 5)
    with store.writer("w/obj") as out:
        for start in range(0, len(data), 2**20):
            out.write(data[start:start + 2**20])
            assert not store.exists("w/obj") and store.list("w/") == []  # not yet visible
    assert store.get_bytes("w/obj") == data
    with store.writer("w/empty"):
        pass
    assert store.get_bytes("w/empty") == b""
    path = tmp_path / "src.bin"
    path.write_bytes(data[::-1])
    store.put_file("w/file", path)
    assert store.get_bytes("w/file") == data[::-1]
    with store.writer("w/obj") as out:  # rewriting a key replaces it whole
        out.write(b"new")
    assert store.get_bytes("w/obj") == b"new"
    assert store.list("w/") == ["w/empty", "w/file", "w/obj"]


def test_a_writer_that_raises_leaves_nothing(store):
    store.put_bytes("w/kept", b"old")
    for key in ("w/kept", "w/new"):
        with pytest.raises(RuntimeError, match="stop"):
            with store.writer(key) as out:
                out.write(b"partial")
                raise RuntimeError("stop")
    assert store.get_bytes("w/kept") == b"old"
    assert not store.exists("w/new")
    assert store.list("w/") == ["w/kept"]


def test_a_large_streamed_object_is_sent_in_parts(seaweed, bucket, tmp_path, monkeypatch):
    from shardrl.store import s3

    monkeypatch.setattr(s3, "STREAM_PART_SIZE", 5 * 2**20)  # the smallest part S3 takes
    store = _s3(seaweed, bucket, prefix=f"parts-{uuid.uuid4().hex[:8]}")
    data = _large(9, 12 * 2**20 + 3)
    with store.writer("big") as out:
        out.write(data)
    path = tmp_path / "big.bin"
    path.write_bytes(data[::-1])
    store.put_file("big-file", path)
    assert store.get_bytes("big") == data and store.get_bytes("big-file") == data[::-1]
    etag = seaweed.client().stat_object(bucket, f"{store.prefix}big").etag
    assert etag.strip('"').endswith("-3")  # a multipart upload of 3 parts
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    store.put_file("small", small)  # one PUT: the plain MD5 as ETag
    etag = seaweed.client().stat_object(bucket, f"{store.prefix}small").etag
    assert etag.strip('"') == hashlib.md5(b"x" * 1000).hexdigest()


def test_a_forked_child_writes_through_its_reopened_store(store):
    """A child process (the learner's commit writer) uses `reopened()`: no connection of the
    parent's, so both go on writing."""
    store.put_bytes("fork/before", b"parent")  # the parent's pool has a connection now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child = store.reopened()
            child.put_bytes("fork/child", child.get_bytes("fork/before") + b"+child")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get_bytes("fork/child") == b"parent+child"
    store.put_bytes("fork/after", b"parent again")
    assert store.list("fork/") == ["fork/after", "fork/before", "fork/child"]
    assert (store.reopened() is store) == isinstance(store, LocalStore)


def test_the_folder_store_sweeps_what_killed_writers_left(tmp_path):
    """A writer killed mid-write leaves its temp file (never listed); the sweep removes
    those under a prefix and nothing else."""
    store = LocalStore(tmp_path)
    store.put_bytes("runs/r/policy/v000001/model.safetensors", b"weights")
    store.put_bytes("runs/other/a.json", b"{}")
    torn = [tmp_path / "runs/r/policy/v000001/.model.safetensors.ab12.tmp",
            tmp_path / "runs/r/.progress.json.cd34.tmp"]
    elsewhere = tmp_path / "runs/other/.a.json.ef56.tmp"
    for path in (*torn, elsewhere):
        path.write_bytes(b"x" * 100)
    assert store.sweep_temp("runs/r/") == (2, 200)
    assert not any(p.exists() for p in torn) and elsewhere.exists()
    assert store.list("runs/r/") == ["runs/r/policy/v000001/model.safetensors"]
    assert store.sweep_temp("runs/r/") == (0, 0)
