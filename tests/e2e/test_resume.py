"""Resume a whole run: `shardrl run --resume RUN_ID` after the runner itself was SIGKILLed."""

from __future__ import annotations

import os
import re
import signal

import pytest

from shardrl.store import RunKeys, open_store

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

pytestmark = pytest.mark.slow


def test_resume_after_the_runner_was_killed(tmp_path):
    store_path = str(tmp_path / "store")
    store = open_store(store_path)
    run_id = "orphan"
    tracking = f"tracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n"
    proc, out = start_runner(tmp_path, run_args(write_config(tmp_path, tracking), store_path,
                                                 run_id), "first")
    wait_for(lambda: version(store, run_id) >= 4, 400, "learner version 4")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = version(store, run_id)
    # the stages die with their runner: none is left to race the stages of the resumed run
    wait_for(lambda: not any(stage_pids(name, run_id) for name in LOOPING), 15,
             "the stages of the killed runner to exit")
    assert not store.exists(RunKeys(run_id).done())

    proc, out = start_runner(tmp_path, ["run", "--resume", run_id, "--store", store_path,
                                        "--no-progress"], "second")
    text = finish(proc, out)
    assert proc.returncode == 0, text[-4000:]
    assert "snapshot" not in text  # the snapshot is not built again
    log = (tmp_path / "store" / "runs" / run_id / "logs" / "learn.log").read_text()
    resumed = [int(v) for v in re.findall(r"resumed at version (\d+)", log)]
    assert len(resumed) == 1 and killed_at <= resumed[0] < STEPS, (killed_at, resumed)
    check_completed(store, run_id, STEPS)
    # the resumed runner forwarded to MLflow only the metric points its predecessor had not
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.info.status == "FINISHED"
    points = [(m.step, m.timestamp, m.value)
              for m in client.get_metric_history(mlflow_run.info.run_id, "learn/policy_loss")]
    assert points and len(points) == len(set(points)), "metric points forwarded twice"


def test_resume_of_an_unknown_run_says_so(tmp_path):
    res = run_cli(["run", "--resume", "nope", "--store", str(tmp_path / "store")], tmp_path,
                  timeout=120)
    assert res.returncode != 0
    assert "--resume nope: no run.json under" in res.stderr
