"""Stages remove their model-file caches: their own when they end, and those of exited
processes (a stage killed before its end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardrl.stages.context import StageContext, cache_root, release_cache


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_release_removes_own_and_exited_caches_keeps_running_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    run = tmp_path / "r1"
    own = run / f"learn-0-{os.getpid()}"
    dead = run / f"rollout-1-{_exited_pid()}"
    alive = run / f"evaluate-0-{os.getppid()}"  # the test runner's parent is running
    for folder in (own, dead, alive):
        (folder / "policy-base").mkdir(parents=True)
        (folder / "policy-base" / "model.safetensors").write_bytes(b"x" * 1024)
    other_run = tmp_path / "r2" / f"learn-0-{os.getpid()}"
    other_run.mkdir(parents=True)

    release_cache("r1")
    assert not own.exists() and not dead.exists()
    assert (alive / "policy-base" / "model.safetensors").exists()
    assert run.exists()  # still holds the running process's cache
    assert other_run.exists()  # another run's caches are not this run's to remove

    (alive / "policy-base" / "model.safetensors").unlink()
    alive.rename(run / f"evaluate-0-{_exited_pid()}")
    release_cache("r1")
    assert not run.exists()  # empty: removed
    release_cache("r1")  # nothing left: no error


def test_stage_context_close_removes_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    from shardrl.config import load_config
    from shardrl.store import LocalStore

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    ctx = StageContext(stage="learn", cfg=load_config(demo), run_id="r3",
                       store=LocalStore(tmp_path / "store"))
    folder = ctx.cache_dir()
    assert folder == tmp_path / "cache" / "r3" / f"learn-0-{os.getpid()}"
    (folder / "ref").mkdir()
    (folder / "ref" / "config.json").write_text("{}")
    ctx.close()
    assert not (tmp_path / "cache" / "r3").exists()


def test_supervisor_removes_the_cache_its_child_left(tmp_path, monkeypatch):
    """A stage killed in its pod leaves its copy; the supervisor removes it once it exits."""
    from argparse import Namespace

    from shardrl.orchestrate import supervise

    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    # the child makes its cache folder as a stage does, then dies without removing it
    script = ("import os, pathlib; p = pathlib.Path(os.environ['SHARDRL_CACHE']) / 'r4' / "
              "f'evaluate-0-{os.getpid()}'; p.mkdir(parents=True); "
              "(p / 'model.safetensors').write_bytes(b'x'); os._exit(0)")
    monkeypatch.setattr(supervise, "child_command", lambda args: [sys.executable, "-c", script])
    monkeypatch.setattr(supervise.signal, "signal", lambda *a: None)  # keep pytest's handlers
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    args = Namespace(config=str(demo), overrides=[], name="evaluate", run_id="r4",
                     store=str(tmp_path / "store"), worker=0, workers=1, once=False)
    assert supervise.run(args) == 0
    assert not (tmp_path / "cache" / "r4").exists()


def test_the_runner_removes_a_crashed_stages_model_cache_when_it_sees_the_exit(tmp_path,
                                                                             monkeypatch):
    """Each process downloads its own copy of the model files (about 0.5 GB a stage for
    SmolLM2): a crashed stage's would add up restart after restart until the run ended."""
    from shardrl.config import load_config
    from shardrl.orchestrate import local
    from shardrl.store import LocalStore

    cfg = load_config("demo", ["pipeline.max_restarts=1"])
    run = local.LocalRun(cfg, "r1", str(tmp_path), LocalStore(str(tmp_path)), tmp_path,
                         tmp_path / "config.yaml")
    released = []
    monkeypatch.setattr(local, "release_cache", released.append)

    class Crashed:
        def poll(self):
            return 1

    run.procs = [local.Proc("rollout", 0, Crashed(), tmp_path / "rollout.log")]

    class Monitor:
        def say(self, text):
            raise KeyboardInterrupt  # stop the loop at its first report

        def tick(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        local.supervise(run, Monitor(), lambda: False)
    assert released == ["r1"]
