"""The runner quotes a failed stage's last error line from its log."""

from __future__ import annotations

import pytest

from shardrl.orchestrate.local import last_error


def test_the_last_error_line_of_a_stage_log(tmp_path):
    log = tmp_path / "snapshot.log"
    log.write_text(
        "10:00:01 snapshot INFO loading\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n'
        "    raise FileNotFoundError(msg)\n"
        "FileNotFoundError: model directory models/m does not exist\n")
    assert last_error(log) == ": FileNotFoundError: model directory models/m does not exist"
    log.write_text("10:00:01 rollout ERROR only prompts longer than the context\n"
                   "10:00:02 rollout INFO closing\n")
    assert last_error(log) == ": 10:00:01 rollout ERROR only prompts longer than the context"
    log.write_text("10:00:01 learn INFO all good\n")
    assert last_error(log) == ""
    log.write_text("10:00:01 learn ERROR an earlier error\nTraceback (most recent call last):\n"
                   '  File "y.py", line 1, in g\n'
                   "shardrl.store.base.StoreUnavailable: " + "x" * 400 + "\n")
    quoted = last_error(log)
    assert quoted.startswith(": shardrl.store.base.StoreUnavailable: x") and len(quoted) == 302
    assert last_error(tmp_path / "missing.log") == ""


def test_a_stage_that_finds_the_config_invalid_is_not_restarted(tmp_path):
    """A looping stage exits with EXIT_CONFIG when its config fails only once it runs (a
    model's modules, a folder): the same config would fail the same way, so the runner stops
    the run at once with the stage's reason, instead of spending its restarts and then
    advising a resume that keeps the config."""
    from types import SimpleNamespace

    from shardrl.config import load_config
    from shardrl.orchestrate.local import LocalRun, Proc, supervise
    from shardrl.stages import EXIT_CONFIG
    from shardrl.store import LocalStore, RunKeys
    from shardrl.store.records import Aborted

    log = tmp_path / "learn.log"
    log.write_text("10:00:01 learn ERROR invalid config: learner.lora.target_modules: ['x'] "
                   "names no module of the model\n")
    ended = SimpleNamespace(poll=lambda: EXIT_CONFIG)
    store = LocalStore(tmp_path / "store")
    lr = LocalRun(cfg=load_config("demo"), run_id="cfg", store_uri=str(tmp_path / "store"),
                  store=store, log_dir=tmp_path, config_path=tmp_path / "c.yaml",
                  procs=[Proc("learn", 0, ended, log)])
    stopped, said = [], []
    lr.stop_all = lambda: stopped.append(True)
    lr.start = lambda name, worker: pytest.fail("restarted")
    monitor = SimpleNamespace(say=said.append, tick=lambda: None)
    assert supervise(lr, monitor, lambda: False) == 1
    assert stopped and len(said) == 1
    assert said[0].startswith("learn found the run's config invalid: 10:00:01 learn ERROR "
                              "invalid config: learner.lora.target_modules"), said
    assert "start a new one with the setting fixed" in said[0]
    marker = Aborted.read(store, RunKeys("cfg").aborted())
    assert marker.exit_code == EXIT_CONFIG and "config is invalid" in marker.reason
