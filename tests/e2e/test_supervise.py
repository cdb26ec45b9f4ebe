"""Restarts inside the pod and the abort marker.

`shardrl stage NAME --supervise` (what a compiled pipeline's looping task runs) restarts its
crashed stage with the local runner's backoff, up to `pipeline.max_restarts`; out of restarts
it writes ABORTED.json and every other looping stage stops on it. The local runner writes the
same marker when it gives a stage up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrl.orchestrate.local import restart_delay
from shardrl.stages import EXIT_RUN_ABORTED
from shardrl.store import RunKeys, open_store
from shardrl.store.records import Aborted

from .conftest import TINY, processes, stage_pids
from .rounds import one_thread, run_round, tiny_config
from .test_faults import wait_for

pytestmark = pytest.mark.slow

SETTINGS = ["learner.total_steps=1000", "pipeline.max_restarts=1"]
"""A run far from its end, whose stages may each be restarted once."""


def stage_cmd(config: Path, store: Path, run_id: str, name: str, *extra: str) -> list[str]:
    sets = [a for s in ["model.sft.enabled=false", *SETTINGS] for a in ("--set", s)]
    return [sys.executable, "-m", "shardrl.cli", "stage", name, "--config", str(config),
            "--run-id", run_id, "--store", str(store), *sets, *extra]


def children(run_id: str, name: str) -> list[int]:
    """Stage processes of `name` for `run_id` that are not supervisors."""
    return [pid for pid, cmd, _ in processes()
            if run_id.encode() in cmd and name.encode() in cmd and b"stage" in cmd
            and b"--supervise" not in cmd]


def test_supervisor_restarts_then_aborts_and_every_looping_stage_stops(tmp_path):
    store = tmp_path / "store"
    cfg = tiny_config(tmp_path, overrides=tuple(SETTINGS))
    with one_thread():
        run_round(open_store(str(store)), cfg, "sv", "snapshot")
    config = tmp_path / "rounds.yaml"
    env = dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("evaluate", "rollout", "learn")}  # noqa: SIM115
    supervisor = subprocess.Popen(stage_cmd(config, store, "sv", "evaluate", "--supervise"),
                                  env=env, stdout=logs["evaluate"], stderr=subprocess.STDOUT)
    # the learner supervised too, as in a cluster; the rollout worker bare
    others = {n: subprocess.Popen(stage_cmd(config, store, "sv", n, *extra), env=env,
                                  stdout=logs[n], stderr=subprocess.STDOUT)
              for n, extra in (("rollout", ()), ("learn", ("--supervise",)))}
    try:
        first = wait_for(lambda: children("sv", "evaluate"), 120, "the evaluate stage")[0]
        os.kill(first, signal.SIGKILL)  # a crash: the supervisor restarts it after 1 s
        second = wait_for(lambda: [p for p in children("sv", "evaluate") if p != first], 60,
                          "the restarted evaluate stage")[0]
        assert supervisor.poll() is None
        text = (tmp_path / "evaluate.log").read_text()
        assert "evaluate exited with -9" in text and f"restarting in {restart_delay(0):g} s (1/1)" \
            in text, text[-3000:]
        time.sleep(3)  # let the restarted stage get going before it crashes again
        os.kill(second, signal.SIGKILL)  # out of restarts: the run is aborted
        assert supervisor.wait(timeout=60) == 128 + signal.SIGKILL
        marker = Aborted.read(open_store(str(store)), RunKeys("sv").aborted(), optional=True)
        assert marker is not None
        assert (marker.stage, marker.worker, marker.exit_code, marker.restarts) == \
            ("evaluate", 0, 137, 1)
        # every other looping stage sees the marker and stops by itself, well within a minute;
        # a supervised one's task then fails with the run, so nothing after the loop runs
        aborted_at = time.monotonic()
        for name, proc in others.items():
            expected = EXIT_RUN_ABORTED if name == "learn" else 0
            assert proc.wait(timeout=60) == expected, \
                (tmp_path / f"{name}.log").read_text()[-3000:]
        assert time.monotonic() - aborted_at < 60
        learn_log = (tmp_path / "learn.log").read_text()
        assert "run aborted: evaluate failed for good" in learn_log
        assert "learn stopped: the run was aborted (evaluate failed for good" in learn_log
        # the cluster's retry of a failed task fails at once, without starting its stage
        retry = subprocess.run(stage_cmd(config, store, "sv", "rollout", "--supervise"), env=env,
                               capture_output=True, text=True, timeout=120)
        assert retry.returncode == EXIT_RUN_ABORTED, retry.stderr[-3000:]
        assert "rollout not started" in retry.stdout + retry.stderr
        # and the other stages' when they ended
        assert not (tmp_path / "cache" / "sv").exists(), list((tmp_path / "cache").rglob("*"))
        assert not open_store(str(store)).exists(RunKeys("sv").done())
    finally:
        for proc in (supervisor, *others.values()):
            if proc.poll() is None:
                proc.kill()
        for handle in logs.values():
            handle.close()


def test_local_runner_out_of_restarts_writes_the_abort_marker(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY + "tracking: {enabled: false}\n")
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardrl.cli", "run", str(config), "--store", str(store),
         "--run-id", "lr", "--no-progress", "--no-report", "--set", "model.sft.enabled=false",
         "--set", "learner.total_steps=1000", "--set", "pipeline.max_restarts=0"],
        env=dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid = wait_for(lambda: stage_pids("evaluate", "lr"), 120, "the evaluate stage")[0]
        time.sleep(1)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "evaluate failed 1 times" in out
    marker = Aborted.read(open_store(str(store)), RunKeys("lr").aborted(), optional=True)
    assert marker is not None and (marker.stage, marker.restarts) == ("evaluate", 0)
    assert marker.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL)
