"""A commit's writes in the child process: the same objects as written in this process,
errors back as themselves, and a child that never outlives its learner."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest
import torch

from procs import alive
from shardrl.config import RunConfig
from shardrl.doctor import saved_findings
from shardrl.models.io import load_state_dict_from_safetensors
from shardrl.stages.learn.offload import (
    PROCESS_MAX_BYTES,
    Check,
    CommitProcess,
    Point,
    Publish,
    Put,
    Writes,
    commit_writes,
    settle,
)
from shardrl.stages.policy import fetch_weights
from shardrl.store import LocalStore, RetryPolicy, RunKeys, StoreUnavailable
from shardrl.store.base import Retrier
from shardrl.store.records import Progress
from shardrl.store.schemas import METRICS
from shardrl.store.shards import write_shard

KEYS = RunKeys("r1")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def states(n: int) -> list[dict[str, torch.Tensor]]:
    """n successive weight states: a float32 and a bfloat16 tensor that change a little each
    version (some elements only, so deltas are sparse), and an integer buffer."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=gen)
    b = torch.randn(300, generator=gen).to(torch.bfloat16)
    out = []
    for v in range(n):
        w = w.clone()
        w[v % 64] += 0.5
        b = b.clone()
        b[: 10 * (v + 1)] = v
        out.append({"w": w, "b": b, "ids": torch.arange(5)})
    return out


def commits(weights: list[dict[str, torch.Tensor]]) -> list[list]:
    """The writes of versions 0.. of `weights` as the snapshot and the learner make them
    (full every 3)."""
    return [[Publish(0, weights[0], 3)]] + [
        [Publish(v, weights[v], 3),
         Put(KEYS.progress(), Progress(version=v, commits=v, time=float(v))), Point(v)]
        for v in range(1, len(weights))]


def store_files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def truncation_chunk(store, seq: int, steps: range, rate: float) -> None:
    """A rollout metrics chunk with `rollout/truncation_rate` = `rate` at `steps`."""
    n = len(steps)
    write_shard(store, KEYS.metrics("rollout", f"w00-{seq}"), pa.table({
        "stage": ["rollout"] * n, "name": ["rollout/truncation_rate"] * n,
        "step": list(steps), "value": [rate] * n, "time": [0.0] * n}), METRICS)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_the_live_doctor_checks_where_the_writes_run(tmp_path, where, caplog):
    """A `Check` runs the doctor in the writer (the child process by default): it reads the
    chunks written so far, records each new finding once in doctor.json and keeps what it
    reported from one check to the next."""
    store = LocalStore(tmp_path)
    out = commit_writes(store, KEYS, where, RunConfig())
    try:
        out.run([Check(2)])
        assert saved_findings(store, KEYS) == []
        truncation_chunk(store, 1, range(5), 0.3)  # 30% truncated for 5 steps (> 10%)
        out.run([Put(KEYS.progress(), Progress(version=5, commits=5, time=5.0)), Check(5)])
        out.run([Check(6)])  # still true, already reported: not again
    finally:
        out.close()
    found = store.get_json(KEYS.state("learn", "doctor.json"))["findings"]
    assert [(f["code"], f["reported_at"]) for f in found] == [("truncation", 5)]
    assert Progress.read(store, KEYS.progress()).version == 5
    if where == "thread":  # the child logs to the learner's stderr, not to this process
        assert "doctor at step 5" in caplog.text


def test_a_check_needs_the_runs_config(tmp_path):
    with pytest.raises(ValueError, match="config"):
        Writes(LocalStore(tmp_path), KEYS).run([Check(1)])


def test_the_child_writes_the_same_objects_as_this_process(tmp_path):
    weights = states(6)
    here, there = LocalStore(tmp_path / "here"), LocalStore(tmp_path / "there")
    child = CommitProcess(there, KEYS)
    try:
        inline = Writes(here, KEYS)
        for writes in commits(weights):
            inline.run(writes)
            child.run(writes)
    finally:
        child.close()
    assert child.process.exitcode == 0
    a, b = store_files(tmp_path / "here"), store_files(tmp_path / "there")
    assert sorted(a) == sorted(b)
    assert any(k.endswith("delta.safetensors") for k in a)
    assert any(k.endswith("model.safetensors") for k in a)  # v3: full
    for key in a:
        if key.endswith(".safetensors") or key.endswith("progress.json"):
            assert a[key] == b[key], key  # bit for bit (the others hold a write time)
    for v in range(1, 6):
        got = fetch_weights(there, KEYS, v)
        assert all(torch.equal(got[k], weights[v][k]) for k in weights[v])


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_delta_is_taken_against_the_last_publish_or_the_base(tmp_path, where):
    """The writer keeps the last version it published; a learner that resumed elsewhere
    gives it that version's weights as its base (sent to the child with the next list)."""
    weights = states(5)
    store = LocalStore(tmp_path)
    out = commit_writes(store, KEYS, where)
    try:
        for writes in commits(weights)[:2]:
            out.run(writes)
        with pytest.raises(ValueError, match="is a delta"):  # v2 missing: no base for v3
            out.run([Publish(4, weights[4], 3)])
        out.base(3, weights[3])  # resumed at v3 (a full snapshot a restart would read)
        out.run([Publish(4, weights[4], 3)])
    finally:
        out.close()
    delta = store.get_bytes(KEYS.policy_file(4, "delta.safetensors"))
    changed = load_state_dict_from_safetensors(delta)
    # v4 against v3: row 4 of w and the first 50 of b changed, the integer buffer did not
    assert sorted(changed) == ["index/b", "index/w", "value/b", "value/w"]
    assert torch.equal(changed["value/w"], weights[4]["w"][4])


class OutageStore(LocalStore):
    """Every progress.json write fails as an outage would."""

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.endswith("progress.json"):
            raise StoreUnavailable("the store is down")
        super().put_bytes(key, data)


def test_an_error_in_the_child_comes_back_as_itself_and_the_child_goes_on(tmp_path):
    weights = states(3)
    child = CommitProcess(OutageStore(tmp_path), KEYS)
    try:
        child.run(commits(weights)[0])
        with pytest.raises(StoreUnavailable, match="the store is down") as raised:
            child.run(commits(weights)[1])
        assert any("in the commit writer process" in note for note in raised.value.__notes__)
        # the weights before the failing record are in the store; the child still serves
        assert fetch_weights(LocalStore(tmp_path), KEYS, 1)["w"].shape == (64, 16)
        child.run([Point(1)])
    finally:
        child.close()


class FlakyStore(LocalStore):
    """A folder store behind a retrier, as the S3 store is: its first two writes of
    progress.json fail as a refused connection would, in whichever process makes them."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self._retrier = Retrier(RetryPolicy(base_delay_s=0.01, max_delay_s=0.02), "flaky",
                                lambda e: isinstance(e, ConnectionError))
        self.failures = 2

    def put_bytes(self, key: str, data: bytes) -> None:
        def op() -> None:
            if key.endswith("progress.json") and self.failures > 0:
                self.failures -= 1
                raise ConnectionError("refused")
            LocalStore.put_bytes(self, key, data)

        self._retrier.call(f"put {key!r}", op)


def test_an_outage_the_child_rides_out_is_logged_by_the_learner(tmp_path, caplog, capfd):
    """The learner waits on the child meanwhile, making no store call of its own: the
    outage reaches its log, once, from the child's report."""
    weights = states(2)
    store = FlakyStore(tmp_path)
    child = CommitProcess(store, KEYS)
    try:
        with caplog.at_level(logging.WARNING, logger="shardrl.store"):
            for writes in commits(weights):
                child.run(writes)
    finally:
        child.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "shardrl.store"]
    assert len(messages) == 2, messages
    assert messages[0] == ("object store flaky unavailable (ConnectionError: refused); "
                           "retrying for up to 60 s or 10 attempts per operation")
    assert re.fullmatch(r"object store flaky available again after [0-9.]+ s", messages[1])
    assert "unavailable" not in capfd.readouterr().err  # the child itself logged nothing
    assert Progress.read(LocalStore(tmp_path), KEYS.progress()).version == 1
    assert store.failures == 2  # the writes were the child's


def test_a_dead_child_fails_the_commit_in_flight(tmp_path):
    child = CommitProcess(LocalStore(tmp_path), KEYS)
    try:
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.join(10)
        with pytest.raises(RuntimeError, match="commit writer process exited"):
            child.run(commits(states(2))[1])
    finally:
        child.close()


def test_the_child_dies_with_its_learner_even_in_the_middle_of_a_write(tmp_path):
    """A SIGKILLed learner leaves no writer behind to land its commit after a restart: the
    child, blocked in a write the learner asked for, is killed and the write never lands."""
    script = textwrap.dedent(f"""
        import os, threading, time
        from shardrl.stages.learn.offload import CommitProcess, Put
        from shardrl.store import LocalStore, RunKeys
        from shardrl.store.records import Progress

        class SlowStore(LocalStore):
            def put_bytes(self, key, data):
                open(os.path.join({str(tmp_path)!r}, "writing"), "w").close()
                time.sleep(30)
                super().put_bytes(key, data)

        keys = RunKeys("r1")
        child = CommitProcess(SlowStore({str(tmp_path / "store")!r}), keys)
        print(child.process.pid, flush=True)
        child.run([Put(keys.progress(), Progress(version=1))])  # blocks for 30 s
    """)
    learner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(learner.stdout.readline())
        deadline = time.monotonic() + 30
        while not (tmp_path / "writing").exists():  # the child is inside the write
            assert time.monotonic() < deadline and learner.poll() is None
            time.sleep(0.05)
        assert alive(pid)
        learner.kill()
        learner.wait(10)
        deadline = time.monotonic() + 10
        while alive(pid):
            assert time.monotonic() < deadline, "the commit writer outlived the learner"
            time.sleep(0.05)
        assert not LocalStore(tmp_path / "store").exists(KEYS.progress())
    finally:
        learner.kill()


def test_a_request_cut_short_never_reaches_the_store(tmp_path):
    """A request whose sending fails part-way stops the child, which never takes what it
    got for a whole request; the writer refuses further work."""
    store = LocalStore(tmp_path)
    child = CommitProcess(store, KEYS)
    weights = states(2)

    class Unsendable(dict):  # the second tensor of the state cannot be sent
        def values(self):
            first, second = list(super().values())[:2]
            yield first
            raise MemoryError("cannot send")

    try:
        with pytest.raises(MemoryError):
            child.run([Publish(0, Unsendable(weights[0]), 3), Point(0)])
        assert child.broken and child.process.exitcode is not None
        with pytest.raises(RuntimeError, match="stopped by an earlier failure"):
            child.run([Point(0)])
    finally:
        child.close()
    assert store.list("") == []


def test_the_child_runs_torch_after_the_learner_used_an_openmp_pool(tmp_path):
    """Forked after the learner's own 2-thread work (its OpenMP pool made), the child still
    takes deltas of tensors above torch's grain size (it stays on one thread)."""
    script = textwrap.dedent(f"""
        import torch
        from shardrl.stages.learn.offload import CommitProcess, Publish
        from shardrl.store import LocalStore, RunKeys
        torch.set_num_threads(2)
        a = torch.randn(2_000_000)
        (a * 2).sum()  # parallel: the pool exists now
        child = CommitProcess(LocalStore({str(tmp_path)!r}), RunKeys("r1"))
        child.run([Publish(0, {{"w": a}}, 2)])
        child.run([Publish(1, {{"w": a + 1}}, 2)])
        child.close()
        print("ok", child.process.exitcode)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["ok", "0"], res.stderr[-2000:]
    assert LocalStore(tmp_path).exists(KEYS.policy_file(1, "delta.safetensors"))


def test_auto_keeps_large_models_on_the_thread(tmp_path):
    store = LocalStore(tmp_path)
    small = settle(commit_writes(store, KEYS, "auto"), "auto", PROCESS_MAX_BYTES)
    large = commit_writes(store, KEYS, "auto")
    child = large.process
    large = settle(large, "auto", PROCESS_MAX_BYTES + 1)
    forced = settle(commit_writes(store, KEYS, "process"), "process", PROCESS_MAX_BYTES + 1)
    try:
        assert isinstance(small, CommitProcess) and isinstance(forced, CommitProcess)
        assert type(large) is Writes and child.exitcode == 0  # the child was stopped
        assert type(commit_writes(store, KEYS, "thread")) is Writes
    finally:
        for out in (small, large, forced):
            out.close()
