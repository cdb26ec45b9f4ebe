"""A shard the learner quarantines does not hold its worker's backlog for good.

One synchronous worker (k = 0, its cap one step's share: a single shard here) writes its
shard and pauses; the shard is then corrupted before the learner reads it. The learner
quarantines it and waits for a batch; the worker must notice, count the shard's groups as
never to be committed and generate again, or the run stops there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shardrl.orchestrate.accounting import account
from shardrl.store import LocalStore, RunKeys

from .conftest import TINY

RUN = "lost"


def stage(name: str, config: Path, store: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, SHARDRL_CACHE=str(store.parent / "cache"), OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "shardrl.cli", "stage", name, "--config",
                                 str(config), "--run-id", RUN, "--store", str(store)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def wait(check, seconds: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert all(p.poll() is None for p in procs), f"a stage ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.1)


def test_a_quarantined_shard_leaves_its_workers_backlog(tmp_path: Path):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY)
    config = tmp_path / "c.yaml"
    config.write_text(f"extends: {tiny}\ntracking: {{enabled: false}}\nrollout: {{workers: 1}}\n"
                      "learner: {total_steps: 3, max_staleness: 0}\n")
    store_dir = tmp_path / "store"
    done = subprocess.run([sys.executable, "-m", "shardrl.cli", "stage", "snapshot", "--config",
                           str(config), "--run-id", RUN, "--store", str(store_dir)],
                          env=dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache")),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store, keys = LocalStore(store_dir), RunKeys(RUN)
    worker_log, learn_log = tmp_path / "rollout.log", tmp_path / "learn.log"
    procs = [stage("rollout", config, store_dir, worker_log)]
    try:
        first = keys.shard("ready", 0, 0, 0)
        wait(lambda: store.exists(first) and "pausing" in worker_log.read_text(), 120,
             "first shard and pause", procs)
        store.put_bytes(first, b"PAR1 torn")  # what the learner will find there
        procs.append(stage("learn", config, store_dir, learn_log))
        wait(lambda: store.exists(keys.done()), 120, "DONE.json", procs)
        for p in procs:
            p.wait(timeout=60)
            assert p.returncode == 0
    finally:
        for p in procs:
            p.kill()
    assert store.exists(keys.quarantine("learn", first))
    assert "quarantined this worker's shard" in worker_log.read_text()
    assert store.get_json(keys.progress())["version"] == 3
    acc = account(store, keys)
    assert acc.balanced and acc.unreadable_quarantined_shards == 1, acc.line()
    assert acc.consumed == 3 * 2 * 4  # three steps of 2 groups of 4 samples
