"""Resume a whole run: `shardrl run --resume RUN_ID` after the runner itself was SIGKILLed."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from shardrl.config import load_config
from shardrl.orchestrate.local import LocalRun
from shardrl.orchestrate.monitor import Monitor
from shardrl.stages.context import MetricsSink
from shardrl.store import LocalStore, RunKeys, open_store

from .conftest import run_cli
from .test_faults import (
    LOOPING,
    STEPS,
    check_completed,
    finish,
    run_args,
    stage_pids,
    start_runner,
    version,
    wait_for,
    write_config,
)


@pytest.mark.slow
def test_resume_after_the_runner_was_killed(tmp_path):
    store_path = str(tmp_path / "store")
    store = open_store(store_path)
    run_id = "orphan"
    proc, out = start_runner(tmp_path, run_args(write_config(tmp_path), store_path, run_id),
                             "first")
    wait_for(lambda: version(store, run_id) >= 4, 400, "learner version 4")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = version(store, run_id)
    # the stages die with their runner: none is left to race the stages of the resumed run
    wait_for(lambda: not any(stage_pids(name, run_id) for name in LOOPING), 15,
             "the stages of the killed runner to exit")
    assert not store.exists(RunKeys(run_id).done())

    proc, out = start_runner(tmp_path, ["run", "--resume", run_id, "--store", store_path,
                                        "--no-progress", "--no-report"], "second")
    text = finish(proc, out)
    assert proc.returncode == 0, text[-4000:]
    assert "snapshot" not in text  # the snapshot is not built again
    log = (tmp_path / "store" / "runs" / run_id / "logs" / "learn.log").read_text()
    resumed = [int(v) for v in re.findall(r"resumed at version (\d+)", log)]
    assert len(resumed) == 1 and killed_at <= resumed[0] < STEPS, (killed_at, resumed)
    check_completed(store, run_id, STEPS)


class RecordingClient:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def log_batch(self, run_id, metrics):  # noqa: ARG002 - MlflowClient's signature
        self.batches.append(metrics)


def test_a_resumed_monitor_forwards_each_step_once(tmp_path):
    """A runner's monitor, started again on the same store, sends MLflow only the steps the
    previous one had not: the one it held (the newest, still open) and the new ones."""
    cfg = load_config(str(write_config(tmp_path)))
    store = LocalStore(tmp_path / "store")
    lr = LocalRun(cfg, "m", str(tmp_path / "store"), store, tmp_path, tmp_path / "c.yaml")
    sink = MetricsSink(store, lr.keys, "learn", 0)

    def monitor() -> Monitor:
        m = Monitor(lr, progress_bar=False)
        m.client, m.mlflow = RecordingClient(), "mlflow-run"
        return m

    first = monitor()
    for step in (1, 2):
        sink.log(step, {"loss": float(step)})
        sink.flush()
        time.sleep(0.002)  # chunk names carry the time in microseconds
    first._forward()
    second = monitor()  # the runner was killed and resumed
    sink.log(3, {"loss": 3.0})
    sink.flush()
    second._forward()
    second._forward()
    second.finish_metrics()
    sent = [[(m.key, m.step, m.value) for m in batch] for batch in second.client.batches]
    assert sent == [[("learn/loss", 2, 2.0)], [("learn/loss", 3, 3.0)]]
    assert [(m.step) for b in first.client.batches for m in b] == [1]


@pytest.mark.slow
def test_resume_of_an_unknown_run_says_so(tmp_path):
    res = run_cli(["run", "--resume", "nope", "--store", str(tmp_path / "store")], tmp_path,
                  timeout=120)
    assert res.returncode != 0
    assert "--resume nope: no run.json under" in res.stderr
