"""The compiled pipelines, run from their IR YAML by `pipelines.emulate` as Kubeflow would run
them: every task a process group with the environment KFP gives its container, ParallelFor
and dependencies as compiled, and the compiled retry policy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from pipelines.shardrl import compile_pipelines
from shardrl.config import load_config
from shardrl.orchestrate.accounting import account
from shardrl.store import RunKeys, open_store

from .conftest import processes

ROOT = Path(__file__).resolve().parents[2]
SHORT = """\
extends: demo
name: short
task:
  source: {kind: builtin, heldout_size: 32}
rollout: {prompts_per_shard: 8}
learner: {batch_prompts: 8}
eval: {every: 2}
tracking: {enabled: false}
"""
SECRETS = {"shardrl-s3": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key",
                          "S3_ENDPOINT_URL": "http://127.0.0.1:9"},
           "shardrl-mlflow": {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}}


def compile_short(tmp: Path, name: str, overrides: list[str], backoff: str = "1s") -> Path:
    """The short demo config compiled; every task's retry backoff set to `backoff` (the
    compiled 30 s would only slow the test down: the count and factor stay as compiled)."""
    config = tmp / "short.yaml"
    config.write_text(SHORT)
    path = compile_pipelines(load_config(str(config), overrides), tmp / "ir", names=(name,))[name]
    spec, platform = yaml.safe_load_all(path.read_text())

    def patch(node):
        if isinstance(node, dict):
            if "retryPolicy" in node:
                node["retryPolicy"]["backoffDuration"] = backoff
            for value in node.values():
                patch(value)

    patch(spec)
    path.write_text(yaml.safe_dump_all([spec, platform], sort_keys=False))
    return path


def emulate(path: Path, tmp: Path, job: str, config: str,
            secrets: dict[str, dict[str, str]] = SECRETS) -> subprocess.Popen:
    (tmp / "secrets.yaml").write_text(yaml.safe_dump(secrets))
    (tmp / "config.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDRL_", "AWS_", "MLFLOW"))}
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.emulate", str(path), "--store", str(tmp / "store"),
         "--param", f"config=@{tmp / 'config.yaml'}", "--secrets", str(tmp / "secrets.yaml"),
         "--job-uuid", job, "--work-dir", str(tmp / "work")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def supervisor_pid(stage: str, job: str) -> int | None:
    """The main process of the task running `stage` for run `job`: the in-pod supervisor."""
    return next((pid for pid, cmd, _ in processes()
                 if job.encode() in cmd and stage.encode() in cmd and b"--supervise" in cmd
                 and b"stage" in cmd), None)


def check_outputs(work: Path, pipeline: str) -> None:
    """The report task wrote its Metrics and HTML artifacts and an executor output that parses
    as KFP's `ExecutorOutput` (the executor checks that), naming the Metrics' values."""
    outputs = work / "outputs" / f"{pipeline}_report"
    assert json.loads((outputs / "artifacts" / "metrics").read_text())
    assert (outputs / "artifacts" / "report").read_text().lstrip().startswith("<")
    executor_output = json.loads((outputs / "executor_output.json").read_text())
    assert executor_output["artifacts"]["metrics"]["artifacts"][0]["metadata"]


def check_run(store: Path, job: str, steps: int) -> dict:
    """The run completed every step, evaluated and promoted, with exact accounting."""
    st = open_store(str(store))
    keys = RunKeys(job)
    done = st.get_json(keys.done())
    assert done["steps"] == steps
    acc = account(st, keys)
    assert acc.balanced, acc.line()
    assert acc.consumed > 0
    assert not st.exists(keys.aborted())
    assert st.get_json(keys.state("promote", "result.json"))["version"] in range(steps + 1)
    return {"done": done, "accounting": acc}


@pytest.mark.slow
def test_async_pipeline_recovers_a_killed_task_by_its_retry_policy(tmp_path):
    job = str(uuid.uuid4())
    path = compile_short(tmp_path, "shardrl", ["learner.total_steps=6"])
    proc = emulate(path, tmp_path, job, SHORT.replace("learner: {batch_prompts: 8}",
                                                   "learner: {batch_prompts: 8, total_steps: 6}"))
    latest = tmp_path / "store" / "runs" / job / "policy" / "LATEST.json"
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        if latest.exists() and json.loads(latest.read_text())["version"] >= 1:
            killed = supervisor_pid("learn", job)  # the pod's main process: the whole task
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=300)
    assert killed is not None, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    # the learn task failed once (killed) and its retry, after the compiled backoff, finished
    assert "shardrl/learn: exited with -9" in out, out[-4000:]
    assert "shardrl/learn: retrying in 1 s (1/3)" in out
    assert "shardrl/learn: started (attempt 2" in out
    assert f"run {job}: SUCCEEDED" in out
    check_run(tmp_path / "store", job, 6)
    check_outputs(tmp_path / "work", "shardrl")
    # the retry is a new pod: its learner resumed from the store where the killed one stopped
    retry_log = (tmp_path / "work" / "logs" / "shardrl_learn.1.log").read_text()
    assert "resumed at version" in retry_log, retry_log[-3000:]


@pytest.mark.slow
def test_sync_pipeline_completes_its_rounds_with_filtering_on(tmp_path):
    """With tracking on: the MLflow secret names a SQLite file, which the monitor, promote
    and report tasks share."""
    job = str(uuid.uuid4())
    # each round's learner takes every group its round made (two workers' 8 prompts): with a
    # batch of 8 it took one shard a round, the next round the other, older one, and whether
    # any group was filtered hung on those two shards alone
    overrides = ["learner.total_steps=2", "learner.batch_prompts=16"]
    path = compile_short(tmp_path, "shardrl-sync", overrides)
    config = (SHORT.replace("tracking: {enabled: false}\n", "")
              .replace("learner: {batch_prompts: 8}",
                       "learner: {batch_prompts: 16, total_steps: 2}"))
    assert load_config(str(path.parent.parent / "short.yaml"), overrides).algo.filters.zero_variance
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    proc = emulate(path, tmp_path, job, config,
                   dict(SECRETS, **{"shardrl-mlflow": {"MLFLOW_TRACKING_URI": tracking}}))
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    # two rounds, one after the other, each: two rollout workers, then learn, then evaluate
    for r in range(2):
        for task in ("rollout-workers[0]/rollout", "rollout-workers[1]/rollout", "learn",
                     "evaluate"):
            assert f"shardrl-sync/rounds[{r}]/{task}: succeeded" in out, out[-4000:]
    assert out.index("rounds[0]/evaluate: succeeded") < out.index("rounds[1]/rollout-workers[0]"
                                                                  "/rollout: started")
    result = check_run(tmp_path / "store", job, 2)
    check_outputs(tmp_path / "work", "shardrl-sync")
    assert result["accounting"].filtered > 0  # zero-variance filtering dropped groups
    # each round's learner checkpointed its optimizer state for the next round's
    st = open_store(str(tmp_path / "store"))
    assert st.get_json(RunKeys(job).latest_learner())["step"] == 2
    # the monitor forwarded the metrics to the run's MLflow run, the report linked it to the
    # KFP run, and promote registered the chosen version
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=tracking)
    (run,) = c.search_runs([c.get_experiment_by_name("shardrl").experiment_id],
                           filter_string=f"tags.`shardrl.run_id` = '{job}'")
    assert run.data.tags["kfp.run_id"] == job
    names = set(run.data.metrics)
    assert {"learn/policy_loss", "rollout/tokens_per_s", "summary/consumed"} <= names, names
    promoted = st.get_json(RunKeys(job).state("promote", "result.json"))
    assert str(promoted["model_version"]) == "1"
    page = (tmp_path / "work" / "outputs" / "shardrl-sync_report" / "artifacts" / "report")
    assert "Registered shardrl-demo v1" in page.read_text()
