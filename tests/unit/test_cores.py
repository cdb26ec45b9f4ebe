"""Core sharing between stage processes: shares, markers, dead processes, no runner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardrl.stages.cores import CORES_ENV, SHARE_ENV, CoreShare, fair_threads


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_fair_threads_splits_cores_and_keeps_the_floor():
    assert fair_threads(cores=8, busy=1, floor=1) == 8
    assert fair_threads(cores=8, busy=3, floor=1) == 2  # 8 // 3
    assert fair_threads(cores=2, busy=3, floor=1) == 1  # never below the floor
    assert fair_threads(cores=2, busy=2, floor=2) == 2
    assert fair_threads(cores=4, busy=0, floor=1) == 4


def test_a_busy_stage_gets_the_cores_others_leave(tmp_path):
    share = CoreShare(tmp_path, cores=4, floor=1)
    with share.busy():
        assert (tmp_path / str(os.getpid())).exists()
        assert torch.get_num_threads() == 4  # alone
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            (tmp_path / str(other.pid)).touch()  # another stage turns busy
            assert share.adjust() == 2 and torch.get_num_threads() == 2
        finally:
            other.kill()
            other.wait()
        # its marker outlived it: a dead process's marker is ignored and removed
        assert share.adjust() == 4
        assert not (tmp_path / str(other.pid)).exists()
    assert not (tmp_path / str(os.getpid())).exists()


def test_without_a_runner_the_configured_threads_stay(monkeypatch):
    monkeypatch.delenv(SHARE_ENV, raising=False)
    monkeypatch.setenv(CORES_ENV, "16")
    torch.set_num_threads(1)
    share = CoreShare.from_env(floor=1)
    with share.busy():
        assert share.adjust() == 1 and torch.get_num_threads() == 1
