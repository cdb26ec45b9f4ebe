"""The local runner's stopping: Ctrl-C reaches a one-shot stage (its own process group gets
no terminal signal), and a stage forked a moment ago, not yet in a group of its own, is
still stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from shardrl.config import load_config
from shardrl.orchestrate import local


def sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)


def test_an_interrupt_stops_a_one_shot_stage(tmp_path, monkeypatch):
    cfg = load_config("demo", ["tracking.enabled=false"])
    lr = local.LocalRun(cfg, "r1", str(tmp_path), None, tmp_path, tmp_path / "c.yaml")
    child = sleeper(process_group=0)
    monkeypatch.setattr(local.LocalRun, "start",
                        lambda self, name, worker=0: local.Proc(name, worker, child, tmp_path / "x"))
    monkeypatch.setattr(local.LocalRun, "sample_rss", lambda self, procs: None)
    asked = []
    lr.interrupted = lambda: asked.append(1) or len(asked) > 2  # Ctrl-C after about a second
    started = time.monotonic()
    assert lr.run_once("snapshot") == local.EXIT_INTERRUPTED
    assert child.poll() == -signal.SIGTERM
    assert time.monotonic() - started < 10


def test_a_stage_not_yet_in_its_own_group_is_stopped_alone():
    child = sleeper()  # in the caller's group, as a forked stage before its setpgid
    try:
        local._signal(child.pid, signal.SIGTERM)  # no group has its pid: the process alone
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    local._signal(child.pid, signal.SIGTERM)  # gone: nothing to do, no error
