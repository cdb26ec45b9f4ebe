"""A run's runner mark (`state/runner/started.json`) holds the run while its runner lives, and
only then: a pid alone may name another process by the time a run is resumed (reused after a
reboot or wrap-around, pid 1 in a container), so the mark also records the process's start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from shardrl.lifetime import process_identity, still_running
from shardrl.orchestrate.local import claim, started_key, takeover_key
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


def _ended_mark() -> dict:
    """The mark of a runner on this machine that has ended."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(gone.pid)
    gone.wait()
    return {"time": 0.0, "host": socket.gethostname(), "pid": gone.pid, "process": identity}


@linux
def test_a_stale_mark_is_taken_over_by_one_runner_only(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r")
    stale = _ended_mark()
    store.put_json(started_key(keys), stale)
    record = store.get_bytes(started_key(keys))
    # another resumer took the stale mark over a moment ago and has not yet written its own
    racer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.put_json(takeover_key(keys, record), {
            "time": 1.0, "host": socket.gethostname(), "pid": racer.pid,
            "process": process_identity(racer.pid)})
        with pytest.raises(SystemExit, match=f"in use by the runner with process id {racer.pid}"):
            claim(store, keys, "store")
        assert store.get_json(started_key(keys)) == stale  # left to the racer
    finally:
        racer.kill()
        racer.wait()
    # the racer stopped before it wrote its mark: its takeover is taken over in turn
    claim(store, keys, "store")
    assert store.get_json(started_key(keys))["pid"] == os.getpid()
    taken = store.get_bytes(takeover_key(keys, store.get_bytes(takeover_key(keys, record))))
    assert taken == store.get_bytes(started_key(keys))


@linux
def test_two_resumers_at_once_one_takes_the_run(tmp_path):
    store, keys = LocalStore(tmp_path / "store"), RunKeys("r")
    store.put_json(started_key(keys), _ended_mark())
    # each runner reads the stale mark, then waits until the other has read it too: both
    # judge it stale before either takes it; a winner stays until the test lets it go
    script = (
        "import os, time\n"
        "from shardrl.orchestrate.local import claim\n"
        "from shardrl.store import LocalStore, RunKeys\n"
        f"here = {str(tmp_path)!r}\n"
        "def flag(name): open(os.path.join(here, f'{name}-{os.getpid()}'), 'w').close()\n"
        "def count(name): return sum(n.startswith(name) for n in os.listdir(here))\n"
        "class Store(LocalStore):\n"
        "    first = True\n"
        "    def get_bytes(self, key):\n"
        "        data = super().get_bytes(key)\n"
        "        if self.first and key.endswith('started.json'):\n"
        "            self.first = False\n"
        "            flag('read')\n"
        "            while count('read') < 2: time.sleep(0.001)\n"
        "        return data\n"
        "claim(Store(os.path.join(here, 'store')), RunKeys('r'), 'store')\n"
        "flag('claimed')\n"
        "while not count('release'): time.sleep(0.01)\n")
    runners = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        # each runner ends by exiting (refused) or by claiming the run and waiting
        while (sum(r.poll() is not None for r in runners)
               + len(list(tmp_path.glob("claimed-*"))) < 2 and time.monotonic() < deadline):
            time.sleep(0.01)
        claimed = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("claimed-*"))
        (tmp_path / "release").touch()
        errors = {r.pid: r.communicate(timeout=60)[1] for r in runners}
    finally:
        for r in runners:
            r.kill()
            r.wait()
    assert len(claimed) == 1, errors
    loser = next(pid for pid in errors if pid != claimed[0])
    assert f"in use by the runner with process id {claimed[0]}" in errors[loser]
    assert store.get_json(started_key(keys))["pid"] == claimed[0]


class LostAnswers(LocalStore):
    """A store whose conditional writes land but answer 'taken', as an S3 put retried after
    a lost response finds its own first attempt's object."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        super().put_if_absent(key, data)
        return False


@linux
def test_a_claim_whose_answers_are_lost_finds_its_own_write(tmp_path):
    store, keys = LostAnswers(tmp_path), RunKeys("r")
    claim(store, keys, "store")  # used to give up: "changed hands 16 times"
    assert store.get_json(started_key(keys))["pid"] == os.getpid()
    # a stale mark taken over, the takeover record's answer lost as well
    store.put_json(started_key(keys), _ended_mark())
    record = store.get_bytes(started_key(keys))
    claim(store, keys, "store")
    assert store.get_json(started_key(keys))["pid"] == os.getpid()
    assert store.get_bytes(takeover_key(keys, record)) == store.get_bytes(started_key(keys))
