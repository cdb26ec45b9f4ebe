"""`shardrl run --resume` of a run that was aborted: the marker is moved aside so the stages
continue, and a run whose stages all ended without DONE.json fails instead of promoting."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from shardrl.config import load_config
from shardrl.orchestrate import local
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import Aborted

KEYS = RunKeys("r1")


def stored_run(tmp_path) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    cfg = load_config("demo", ["tracking.enabled=false", "pipeline.local.fork=false"])
    store.put_json(KEYS.run_json(), {"config": cfg.model_dump(mode="json")})
    return store


def resume_args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(resume="r1", store=str(tmp_path / "store"), config=None,
                              overrides=[], run_id=None, no_progress=True, no_report=True)


def test_resuming_an_aborted_run_moves_its_marker_aside(tmp_path, capsys):
    store = stored_run(tmp_path)
    marker = Aborted(stage="learn", exit_code=1, restarts=3, reason="out of restarts",
                     time=1234.5)
    marker.write(store, KEYS.aborted())
    local.prepare_run(resume_args(tmp_path))
    assert not store.exists(KEYS.aborted())
    kept = KEYS.state("runner", "aborted-1234500.json")
    assert Aborted.read(store, kept) == marker
    assert "resuming a run that was aborted (learn failed for good" in capsys.readouterr().out
    local.prepare_run(resume_args(tmp_path))  # nothing to move the second time
    assert not store.exists(KEYS.aborted())


def test_stages_that_all_end_without_done_fail_the_run(tmp_path, monkeypatch, capsys):
    """Nothing promotes a run whose looping stages stopped early (here: all exited 0 on
    an abort marker written while they ran)."""
    store = stored_run(tmp_path)
    promoted = []

    def supervise(lr, monitor, interrupted):
        Aborted(stage="learn", exit_code=3, reason="no learning signal",
                time=time.time()).write(store, KEYS.aborted())
        return 0

    ended = SimpleNamespace(popen=SimpleNamespace(poll=lambda: 0, wait=lambda timeout: 0))
    monkeypatch.setattr(local.LocalRun, "start", lambda self, name, worker: ended)
    monkeypatch.setattr(local, "supervise", supervise)
    monkeypatch.setattr(local, "one_shot", lambda lr, name: promoted.append(name) or 0)
    assert local.run(resume_args(tmp_path)) == 1
    assert promoted == []
    out = capsys.readouterr().out
    assert "stopped before the run was done: run aborted: learn stopped the run" in out
    assert "--resume r1" in out


def test_a_resume_refused_because_the_run_is_held_leaves_the_abort_marker(tmp_path,
                                                                         monkeypatch):
    """A second runner is refused before it writes anything: the abort marker, which the
    first runner's stages stop on, stays where it is."""
    import pytest

    store = stored_run(tmp_path)
    Aborted(stage="learn", exit_code=1, reason="out of restarts", time=1.0).write(
        store, KEYS.aborted())

    def held(store, keys, uri):
        raise SystemExit("shardrl run: run r1 is being run by another runner")

    monkeypatch.setattr(local, "claim", held)
    with pytest.raises(SystemExit, match="another runner"):
        local.prepare_run(resume_args(tmp_path))
    assert store.exists(KEYS.aborted())
