"""Resume a whole run: `shardrl run --resume RUN_ID` after the runner itself was SIGKILLed."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrl.config import load_config
from shardrl.orchestrate.local import LocalRun, finished, prepare_run, started_key
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
    # what a write killed mid-way leaves: never listed, so only the runner's sweep removes it
    torn = tmp_path / "store" / "runs" / run_id / "policy" / ".model.safetensors.0f0f.tmp"
    torn.write_bytes(b"\0" * 4096)

    proc, out = start_runner(tmp_path, ["run", "--resume", run_id, "--store", store_path,
                                        "--no-progress", "--no-report"], "second")
    text = finish(proc, out)
    assert proc.returncode == 0, text[-4000:]
    # (the killed stages may have left temp files of their own, writes cut off mid-way)
    assert not torn.exists() and re.search(r"removed \d+ temporary file\(s\)", text)
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


def test_resume_refuses_settings_it_would_ignore(tmp_path):
    res = run_cli(["run", "--resume", "r1", "--store", str(tmp_path / "store"), "--set",
                   "learner.total_steps=80", "--run-id", "r2"], tmp_path, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert ("--resume continues run r1 with the config it started with, so --set, --run-id "
            "would be ignored; drop them") in res.stderr
    res = run_cli(["run", "demo", "--resume", "r1", "--store", str(tmp_path / "store")],
                  tmp_path, timeout=60)
    assert "--resume r1: the run keeps the config it started with; demo is not used" in res.stderr


def test_a_finished_run_is_not_resumed(tmp_path):
    """Resuming a finished run started every stage to find nothing to do, and rewrote the
    run's summary (peak memory, CPU share) with those seconds' figures."""
    store = LocalStore(tmp_path / "store")
    keys = RunKeys("done")
    store.put_json(keys.run_json(), {"config": {}})
    store.put_json(keys.done(), {"steps": 6})
    # the learner done but nothing promoted yet: a resume goes on (to evaluate and promote)
    assert not finished(store, keys)
    store.put_json(keys.state("promote", "result.json"), {"version": 6})
    assert not finished(store, keys)  # the runner stopped before the run's summary
    summary = keys.state("runner", "summary.json")
    store.put_json(summary, {"mlflow_complete": False})
    assert not finished(store, keys)  # MLflow lacks metrics: a resume sends them
    store.put_json(summary, {"mlflow_complete": True})
    assert finished(store, keys)
    before = sorted(store.list(""))
    res = run_cli(["run", "--resume", "done", "--store", str(tmp_path / "store")], tmp_path,
                  timeout=60)
    assert res.returncode == 1 and res.stderr.strip() == (
        "--resume done: the run has finished (the learner is done, promote has chosen its "
        "version and MLflow has its metrics): nothing to resume. `shardrl report done` shows "
        "it again; `shardrl replay` trains a copy under changed settings"), res.stderr[-2000:]
    assert sorted(store.list("")) == before
    config = write_config(tmp_path)
    res = run_cli(run_args(config, str(tmp_path / "store"), "done"), tmp_path, timeout=120)
    assert res.returncode == 1 and "already exists in" in res.stderr
    assert "has finished (`shardrl report done` shows it); pick another --run-id" in res.stderr


def test_a_new_run_refuses_an_id_the_store_already_holds(tmp_path):
    """Starting `shardrl run` again with a finished or interrupted run's id used to go on with
    that run under the new config (its stages read the new one, run.json held the old)."""
    config = write_config(tmp_path)
    store = LocalStore(tmp_path / "store")
    keys = RunKeys("taken")
    store.put_json(keys.run_json(), {"config": {}})
    before = sorted(store.list(""))
    res = run_cli(run_args(config, str(tmp_path / "store"), "taken"), tmp_path, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "run taken already exists in" in res.stderr
    assert "`shardrl run --resume taken --store " in res.stderr
    assert sorted(store.list("")) == before  # nothing written, no stage started
    res = run_cli(run_args(config, str(tmp_path / "store"), "no/such"), tmp_path, timeout=120)
    assert res.returncode == 1 and "run_id must match" in res.stderr
    assert "Traceback" not in res.stderr


def test_an_mlflow_that_does_not_answer_is_said_within_seconds(tmp_path, tiny_config):
    """Nothing listens at the tracking address: MLflow's own retries took about four minutes
    before the run's one line; its first contact is brief now, and the run id stays free."""
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", *run_args(tiny_config, str(tmp_path / "store"),
                                                         "down")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                 MLFLOW_TRACKING_URI=f"http://alice:pw0rd@127.0.0.1:{port}/"))
    assert res.returncode == 1, res.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert res.stderr.startswith(f"shardrl run: MLflow at http://***@127.0.0.1:{port}/ failed")
    assert "pw0rd" not in res.stdout + res.stderr and "Traceback" not in res.stderr
    assert not LocalStore(tmp_path / "store").exists(started_key(RunKeys("down")))


def test_a_new_run_refuses_an_id_that_already_names_an_mlflow_run(tmp_path, tiny_config):
    """The store was deleted (or another one is used) but the MLflow database kept the earlier
    run of that id: a new run would have logged into it, and promote registered its model on
    it. A run stopped before its snapshot wrote anything (the runner had created its MLflow
    run) starts again on that MLflow run."""
    from shardrl.tracking.mlflow_run import find_or_create_run

    cfg = load_config(str(tiny_config))
    earlier = find_or_create_run(cfg, "again")
    store = LocalStore(tmp_path / "store")
    for _ in range(2):  # refused, and refused again: the refusal leaves no trace to reuse
        res = run_cli(run_args(tiny_config, str(tmp_path / "store"), "again"), tmp_path,
                      timeout=180)
        assert res.returncode == 1, res.stderr[-2000:]
        assert f"run id again already names MLflow run {earlier}" in res.stderr
        assert not store.exists(RunKeys("again").run_json())
        assert not store.exists(started_key(RunKeys("again")))
        # nor the resolved config the runner had written under the run's logs
        assert not (tmp_path / "store" / "runs" / "again" / "logs").exists()

    def prepared(root: Path) -> LocalRun:
        args = argparse.Namespace(resume=None, config=str(tiny_config), overrides=[],
                                  run_id="again", store=str(root))
        return prepare_run(args)

    assert prepared(tmp_path / "empty").new  # its own logs folder aside, nothing there
    # the runner's mark, as a runner stopped during the snapshot's SFT leaves it
    LocalStore(tmp_path / "stopped").put_json(started_key(RunKeys("again")), {"time": 0})
    lr = prepared(tmp_path / "stopped")
    assert not lr.new
    assert find_or_create_run(cfg, "again", new=lr.new) == earlier
    # (that took the run over for this process, as a runner does: its mark, as it ended)
    LocalStore(tmp_path / "stopped").put_json(started_key(RunKeys("again")), {"time": 0})
    # such a run cannot be resumed (there is nothing to resume from): the error says what to do
    res = run_cli(["run", "--resume", "again", "--store", str(tmp_path / "stopped")], tmp_path,
                  timeout=120)
    assert res.returncode == 1
    assert "stopped before its snapshot finished" in res.stderr
    # with the config the first runner resolved, its overrides included
    saved = tmp_path / "stopped" / "runs" / "again" / "logs" / "config.yaml"
    assert f"start it again with `shardrl run {saved} --run-id again --store " in res.stderr


def test_a_run_stopped_before_its_snapshot_starts_again_under_its_id(tmp_path, tiny_config):
    """The runner marks the store once the MLflow run exists, before any stage: a run that
    stopped before its snapshot wrote anything (here its task file was missing) is the
    runner's own when started again with that id, not an earlier run's."""
    store = LocalStore(tmp_path / "store")
    keys = RunKeys("marked")
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"extends: {tiny_config}\ntask:\n  source: {{kind: dataset, "
                      f"train_path: {tmp_path}/none.jsonl, eval_path: {tmp_path}/none.jsonl}}\n")
    res = run_cli(run_args(broken, str(tmp_path / "store"), "marked"), tmp_path, timeout=180)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "none.jsonl: no such file" in res.stderr and "Traceback" not in res.stderr
    assert store.exists(started_key(keys)) and not store.exists(keys.run_json())
    proc, out = start_runner(tmp_path, run_args(tiny_config, str(tmp_path / "store"), "marked"),
                             "marked-again")
    text = finish(proc, out, timeout=600)
    assert proc.returncode == 0, text[-3000:]
    assert store.exists(keys.done())


@pytest.mark.slow
def test_stopped_stages_write_their_buffered_metrics(tmp_path):
    """Ctrl-C: the runner SIGTERMs its stages, which stop through their `finally` blocks, so
    the metrics they buffer (written every 5 s otherwise) reach the store: the learner's reach
    the version it had committed when it stopped."""
    store_path = str(tmp_path / "store")
    store = open_store(store_path)
    run_id = "stopped"
    proc, out = start_runner(tmp_path, run_args(write_config(tmp_path), store_path, run_id,
                                                "learner.doctor_every=1000"), "first")
    wait_for(lambda: version(store, run_id) >= 4, 400, "learner version 4")
    os.kill(proc.pid, signal.SIGINT)
    text = finish(proc, out)
    stopped_at = version(store, run_id)
    assert proc.returncode == 130 and stopped_at < STEPS, text[-3000:]
    steps = learner_steps(tmp_path / "store", run_id, "learn/update_s")
    assert steps and max(steps) >= stopped_at, (sorted(steps), stopped_at)
    log = (tmp_path / "store" / "runs" / run_id / "logs" / "learn.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def learner_steps(store: Path, run_id: str, name: str) -> list[int]:
    """The steps of metric `name` among the learner's metric chunks."""
    import pyarrow.parquet as pq

    steps = []
    for f in sorted((store / "runs" / run_id / "metrics" / "learn").rglob("*.parquet")):
        t = pq.read_table(f)
        steps += [s for n, s in zip(t.column("name").to_pylist(), t.column("step").to_pylist(),
                                    strict=True) if n == name]
    return steps


def test_a_second_runner_on_a_run_in_use_is_refused_before_it_writes(tmp_path, tiny_config):
    """Two runners on one run id (the same --run-id, or a --resume of a running run) would
    write over each other's config and state: the second is refused while the first lives,
    and the first's config stands. A mark left by a runner that has ended is taken over."""
    store_path = str(tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    keys = RunKeys("shared")
    proc, out = start_runner(tmp_path, run_args(tiny_config, store_path, "shared", "seed=1"),
                             "first")
    wait_for(lambda: store.exists(started_key(keys)), 120, "the first runner's mark")
    config = tmp_path / "store" / "runs" / "shared" / "logs" / "config.yaml"
    wait_for(config.exists, 120, "the first runner's config")
    for args in (run_args(tiny_config, store_path, "shared", "seed=2"),
                 ["run", "--resume", "shared", "--store", store_path, "--no-progress"]):
        res = run_cli(args, tmp_path, timeout=120)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert (f"run shared in {store_path} is in use by the runner with process id "
                f"{proc.pid}") in res.stderr, res.stderr[-2000:]
        assert "seed: 1\n" in config.read_text()
    text = finish(proc, out)
    assert proc.returncode == 0, text[-3000:]
    assert store.get_json(keys.run_json())["config"]["seed"] == 1

    # the first runner has ended: its mark no longer holds the run (one stopped before its
    # summary, so that there is something to resume: a finished run is not resumed)
    store.delete(keys.state("runner", "summary.json"))
    args = argparse.Namespace(resume="shared", config=None, overrides=[], run_id=None,
                              store=store_path)
    lr = prepare_run(args)
    assert store.get_json(started_key(keys))["pid"] == os.getpid() and not lr.new


def test_ctrl_c_during_the_snapshot_says_how_to_start_the_same_run_again(tmp_path, tiny_config):
    """Nothing can be resumed before run.json: the hint starts the run again under its id from
    the config it resolved (overrides included), and that command completes it."""
    store_path = str(tmp_path / "store")
    # an SFT long enough (patience as long as its epochs) to be stopped in
    proc, out = start_runner(tmp_path, run_args(tiny_config, store_path, "early",
                                                "learner.total_steps=12",
                                                "model.sft.max_epochs=2000",
                                                "model.sft.patience=1000"), "first")
    snapshot_log = tmp_path / "store" / "runs" / "early" / "logs" / "snapshot.log"
    wait_for(snapshot_log.exists, 120, "the snapshot to start")
    os.kill(proc.pid, signal.SIGINT)
    text = finish(proc, out)
    assert proc.returncode == 130, text[-3000:]
    assert "INFO mlflow" not in text  # MLflow's database set-up stays out of the output
    hint = re.search(r"start it again with `shardrl (run \S+ --run-id early --store \S+)`", text)
    assert hint, text[-3000:]
    assert hint.group(1).split()[1].endswith("runs/early/logs/config.yaml")
    assert "max_epochs: 2000" in Path(hint.group(1).split()[1]).read_text()
    res = run_cli([*hint.group(1).split(), "--no-progress", "--set", "model.sft.max_epochs=2",
                   "--set", "model.sft.patience=1"], tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    check_completed(LocalStore(tmp_path / "store"), "early", 12)


def test_ctrl_c_while_the_runner_starts_up_stops_it(tmp_path):
    """A Ctrl-C in the runner's first seconds (the libraries loading and warming up, before
    any stage) used to raise a KeyboardInterrupt that library code could swallow: the run
    then went on to its end and exited 0. Now it is noted and answered once the runner can
    stop cleanly, with the command that starts the run again."""
    store_path = str(tmp_path / "store")
    proc, out = start_runner(tmp_path, run_args(write_config(tmp_path), store_path, "early"),
                             "early")
    wait_for(lambda: "run early: store" in out.read_text(), 120, "the runner's first line")
    os.kill(proc.pid, signal.SIGINT)  # during the warm-up: no stage has started
    text = finish(proc, out, timeout=300)
    assert proc.returncode == 130, text[-3000:]
    assert "interrupted before the run started; start it again with `shardrl run" in text
    assert "--run-id early" in text and "Traceback" not in text
    store = open_store(store_path)
    assert not store.exists(RunKeys("early").run_json())  # nothing of the run but its mark
