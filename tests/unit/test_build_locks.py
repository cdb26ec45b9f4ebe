"""A torch extension build lock left by a killed process no longer stalls DeepSpeed's start."""

from __future__ import annotations

import os
import time

from shardrl.learner_backends.deepspeed_backend import stale_build_locks_removed


def _lock(path, age_s: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_stale_lock_is_removed_while_ops_load_and_a_young_one_is_waited_for(tmp_path, caplog):
    stale = _lock(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", 1000)
    slow = _lock(tmp_path / "fused_adam" / "lock", 120)  # a long build still under way
    fresh = _lock(tmp_path / "cpu_adam" / "lock", 0)
    with caplog.at_level("INFO", logger="shardrl.learn"):
        with stale_build_locks_removed(tmp_path, stale_s=900, every_s=0.01):
            deadline = time.monotonic() + 10
            while stale.exists():  # as torch's FileBaton.wait polls for the lock to go
                assert time.monotonic() < deadline, "the stale lock was not removed"
                time.sleep(0.01)
            time.sleep(0.05)  # a few more sweeps: each lock is reported once
    assert slow.exists() and fresh.exists()
    assert caplog.text.count(f"removed {stale}") == 1 and "was killed" in caplog.text
    assert caplog.text.count(f"waiting for {slow}") == 1
    assert str(fresh) not in caplog.text
