"""A run's runner mark (`state/runner/started.json`) holds the run while its runner lives, and
only then: a pid alone may name another process by the time a run is resumed (reused after a
reboot or wrap-around, pid 1 in a container), so the mark also records the process's start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardrl.lifetime import process_identity, still_running
from shardrl.orchestrate.local import claim, started_key
from shardrl.store import LocalStore, RunKeys

linux = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


@linux
def test_a_reused_pid_does_not_hold_the_run(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r")
    # the mark of a runner that has ended; its pid now belongs to a live process
    # (pid 1), which started at another time than the runner did
    other = process_identity(1)
    assert other is not None and still_running(1, other)
    boot, started = other.rsplit(":", 1)
    ended = {"time": 0.0, "host": socket.gethostname(), "pid": 1,
             "process": f"{boot}:{int(started) + 1}"}
    store.put_json(started_key(keys), ended)
    claim(store, keys, "store")
    assert store.get_json(started_key(keys))["pid"] == os.getpid()
    assert store.get_json(started_key(keys))["process"] == process_identity(os.getpid())


@linux
def test_a_live_runner_holds_the_run(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.put_json(started_key(keys), {"time": 0.0, "host": socket.gethostname(),
                                           "pid": live.pid,
                                           "process": process_identity(live.pid)})
        with pytest.raises(SystemExit, match=f"in use by the runner with process id {live.pid}"):
            claim(store, keys, "store")
    finally:
        live.kill()
        live.wait()
    # ended: its pid no longer runs
    claim(store, keys, "store")
    assert store.get_json(started_key(keys))["pid"] == os.getpid()


def test_a_mark_without_the_process_start_goes_by_the_pid(tmp_path):
    """Marks written before the start was recorded: a live pid holds the run, as it did."""
    store, keys = LocalStore(tmp_path), RunKeys("r")
    store.put_json(started_key(keys), {"time": 0.0, "host": socket.gethostname(), "pid": 1})
    with pytest.raises(SystemExit, match="in use by the runner with process id 1"):
        claim(store, keys, "store")
    assert still_running(os.getpid(), None)
