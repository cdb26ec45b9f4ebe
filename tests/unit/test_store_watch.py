"""Store waits: a commit wakes a waiting stage; nothing else does."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import pytest

from shardrl.store import LocalStore
from shardrl.store.watch import InotifyWatch, PollWatch


def _later(delay: float, action) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), action()))
    t.start()
    return t


def _woken_by(watch, action) -> float:
    """Seconds until `action`, run 50 ms from now on another thread, wakes `watch`."""
    t = _later(0.05, action)
    started = time.monotonic()
    assert watch.wait(5.0) is True
    woke = time.monotonic() - started
    t.join()
    return woke


def test_folder_store_wakes_on_a_commit_in_a_new_version_folder(tmp_path):
    store = LocalStore(tmp_path)
    watch = store.watch("runs/r/ready/", depth=1)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    assert watch.wait(0.05) is False  # nothing committed: the full timeout, then False
    # a new version folder appears (wakes: objects may land before its watch), then a shard
    assert _woken_by(watch, lambda: store.put_bytes("runs/r/ready/v000001/w00-000000.parquet",
                                                    b"x")) < 2.0
    while watch.wait(0.05):  # drain what that commit reported
        pass
    # a second shard in the now-watched folder wakes the waiter within milliseconds
    woke = _woken_by(watch, lambda: store.put_bytes("runs/r/ready/v000001/w00-000001.parquet",
                                                    b"y"))
    assert woke < 1.0, woke
    watch.close()


def test_folder_store_ignores_other_prefixes_and_temp_files(tmp_path):
    store = LocalStore(tmp_path)
    watch = store.watch("runs/r/state/learn/", depth=0)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    store.put_json("runs/r/state/rollout/w00.json", {"next_seq": 1})  # another folder
    (tmp_path / "runs/r/state/learn/.progress.json.123.tmp").write_bytes(b"{}")  # a temp file
    assert watch.wait(0.1) is False
    store.put_json("runs/r/state/learn/progress.json", {"version": 1})
    assert watch.wait(1.0) is True
    watch.close()


def test_a_write_first_commit_wakes_the_waiter(tmp_path):
    """`put_if_absent` gives the object its name by a hard link, which the kernel reports as
    a creation, not a rename: a stage waiting on the run's abort marker slept out its timeout."""
    store = LocalStore(tmp_path)
    watch = store.watch("runs/r/", depth=0)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    woke = _woken_by(watch, lambda: store.put_if_absent("runs/r/ABORTED.json", b"{}"))
    assert woke < 1.0, woke
    watch.close()


def test_poll_watch_backs_off_to_the_timeout_and_resets():
    watch = PollWatch(min_s=0.001)
    delays = []
    for _ in range(5):
        started = time.monotonic()
        assert watch.wait(0.004) is True
        delays.append(time.monotonic() - started)
    assert watch.delay == 0.004  # doubled 1 -> 2 -> 4 ms, then held at the timeout
    watch.reset()
    assert watch.delay == 0.001
    assert delays[0] < delays[-1] + 0.05


def test_changed_reports_a_commit_once_without_waiting(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("runs/r/ready/v000000/w00-000000.parquet", b"x")
    watch = store.watch("runs/r/ready/", depth=1)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    assert watch.changed() is False  # committed before the watch: a caller lists once anyway
    store.put_bytes("runs/r/ready/v000000/w00-000001.parquet", b"y")
    assert watch.changed() is True
    assert watch.changed() is False  # taken
    store.put_bytes("runs/r/ready/v000000/w00-000002.parquet", b"z")
    assert watch.wait(1.0) is True  # `wait` takes it too
    assert watch.changed() is False
    watch.close()
    # polling cannot tell: always look
    assert PollWatch().changed() is True


class OutOfWatches:
    """libc whose `inotify_add_watch` fails as when the user's inotify watches are used up."""

    def __init__(self, libc) -> None:
        self.libc = libc

    def __getattr__(self, name):
        return getattr(self.libc, name)

    def inotify_add_watch(self, fd, path, mask):
        ctypes.set_errno(errno.ENOSPC)
        return -1


def test_a_watch_out_of_inotify_watches_polls_instead_of_failing(tmp_path, capsys):
    """Watching a new version folder used to raise out of `wait` and end the stage."""
    store = LocalStore(tmp_path)
    watch = store.watch("runs/r/ready/", depth=1)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    watch.libc = OutOfWatches(watch.libc)
    store.put_bytes("runs/r/ready/v000001/w00-000000.parquet", b"x")  # a new folder
    assert watch.wait(1.0) is True
    assert watch.polling is not None and "polling" in capsys.readouterr().err
    # unwatched, that folder's next shard is still found: every wait now returns to look
    assert watch.changed() is True
    started = time.monotonic()
    assert watch.wait(5.0) is True and time.monotonic() - started < 1.0
    watch.close()


def test_folders_made_while_events_were_lost_are_watched_again(tmp_path):
    store = LocalStore(tmp_path)
    watch = store.watch("runs/r/ready/", depth=1)
    if not isinstance(watch, InotifyWatch):
        pytest.skip("no inotify on this system")
    (tmp_path / "runs/r/ready/v000002").mkdir()
    time.sleep(0.05)
    os.read(watch.fd, 1 << 16)  # its event lost, as in a queue overflow
    watch._rescan()  # what an overflow event makes the watch do
    t = _later(0.05, lambda: store.put_bytes("runs/r/ready/v000002/w00-000000.parquet", b"x"))
    started = time.monotonic()
    assert watch.wait(5.0) is True and time.monotonic() - started < 1.0
    t.join()
    watch.close()
