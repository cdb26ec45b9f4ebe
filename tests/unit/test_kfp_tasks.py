"""The pipeline's report task: KFP Metrics and HTML artifacts, executor output, run links."""

from __future__ import annotations

import json
from types import SimpleNamespace

from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

from shardrl.config import RunConfig
from shardrl.orchestrate import kfp_tasks

SUMMARY = {
    "done": {"steps": 12},
    "evals": {"0": {"pass_at_1": 0.25}, "12": {"pass_at_1": 0.5}, "6": {"pass_at_1": 0.375}},
    "accounting": {"generated": 96, "consumed": 80, "balanced": True, "dropped_stale": 16},
    "promote": {"model_name": "m", "model_version": "3", "version": 12, "champion": True},
}


def test_metrics_are_the_final_pass_rate_steps_and_accounting():
    assert kfp_tasks.kfp_metrics(SUMMARY) == {
        "steps": 12.0, "pass_at_1_baseline": 0.25, "pass_at_1_final": 0.5,
        "final_version": 12.0, "samples_generated": 96.0, "samples_consumed": 80.0,
        "samples_dropped_stale": 16.0, "registered_version": 3.0}
    # a run without evaluations or promotion still reports its steps
    assert kfp_tasks.kfp_metrics({"done": {"steps": 0}}) == {"steps": 0.0}
    # without v0's evaluation there is no baseline (v6 is not one)
    assert kfp_tasks.kfp_metrics({"done": {"steps": 12}, "evals": {
        "6": {"pass_at_1": 0.375}, "12": {"pass_at_1": 0.5}}}) == {
        "steps": 12.0, "pass_at_1_final": 0.5, "final_version": 12.0}


def test_outputs_reach_kfp_through_the_executor_output(tmp_path):
    executor_input = json.dumps({"outputs": {
        "artifacts": {"metrics": {"artifacts": [{"uri": "s3://b/m"}]}},
        "outputFile": str(tmp_path / "tmp" / "executor_output.json")}})
    metrics = kfp_tasks.kfp_metrics(SUMMARY)
    page = kfp_tasks.report_html("run-1", SUMMARY, metrics, {
        "MLflow run": "http://mlflow:5000/#/experiments/1/runs/abc", "Kubeflow run": None})
    kfp_tasks.write_outputs(executor_input, str(tmp_path / "s3/b/m"),
                            str(tmp_path / "s3/b/r"), metrics, page)
    assert json.loads((tmp_path / "s3/b/m").read_text()) == metrics
    html = (tmp_path / "s3/b/r").read_text()
    assert "http://mlflow:5000/#/experiments/1/runs/abc" in html and "Kubeflow run" not in html
    assert "<td>pass_at_1_final</td><td>0.5</td>" in html and "champion" in html
    # the launcher parses the file as an ExecutorOutput and merges the metadata into the
    # Metrics artifact, which the run's UI shows
    out = json_format.Parse((tmp_path / "tmp/executor_output.json").read_text(),
                            pb.ExecutorOutput())
    meta = json_format.MessageToDict(out.artifacts["metrics"].artifacts[0].metadata)
    assert meta == metrics
    # tracking off: promote chose a version but registered nothing
    chosen = dict(SUMMARY, promote={"version": 12, "metric": "pass_at_1", "value": 0.5})
    page = kfp_tasks.report_html("run-1", chosen, kfp_tasks.kfp_metrics(chosen), {})
    assert "Chose policy v12; tracking is off, so no model was registered." in page
    assert "None" not in page


class Client:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tag(self, run, key, value):
        assert run == "ml-1"
        self.tags[key] = value

    def get_run(self, run):
        return SimpleNamespace(info=SimpleNamespace(experiment_id="7"))


def test_the_mlflow_run_and_the_kfp_run_link_to_each_other(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    cfg = RunConfig.model_validate({"pipeline": {"ui_endpoint": "https://kf.example.com/"}})
    view = SimpleNamespace(cfg=cfg, run_id="5f0c")
    monitor = SimpleNamespace(mlflow="ml-1", client=Client())
    assert kfp_tasks.link_runs(monitor, view) == "http://mlflow:5000/#/experiments/7/runs/ml-1"
    assert monitor.client.tags == {"kfp.run_id": "5f0c",
                                   "kfp.run_url": "https://kf.example.com/#/runs/details/5f0c"}
    # without a UI address only the id; without tracking nothing
    view.cfg = RunConfig()
    monitor.client = Client()
    kfp_tasks.link_runs(monitor, view)
    assert monitor.client.tags == {"kfp.run_id": "5f0c"}
    assert kfp_tasks.link_runs(SimpleNamespace(mlflow=None), view) is None


def test_the_monitor_and_report_tasks_open_their_mlflow_run(tmp_path):
    """The `monitor` and `report` tasks build their `Monitor` from `open_view`; with tracking
    on (the default) it failed on a field the local runner sets (whether the run is new)
    before forwarding anything. Twice, as a retried task would: one MLflow run, found again."""
    from shardrl.orchestrate.monitor import Monitor
    from shardrl.tracking.mlflow_run import RUN_TAG, client

    config = tmp_path / "run.yaml"
    config.write_text(f"extends: demo\ntracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    runs = []
    for _ in range(2):
        view = kfp_tasks.open_view(str(config), "kfp-run-1", str(tmp_path / "store"))
        runs.append(Monitor(view, progress_bar=False).mlflow)
    assert runs[0] is not None and runs[0] == runs[1]
    c = client(view.cfg)
    assert c.get_run(runs[0]).data.tags[RUN_TAG] == "kfp-run-1"


def test_points_logged_after_done_reach_mlflow_once(tmp_path):
    """At DONE.json a rollout worker may still log its last batch: the `monitor` task sends
    only settled steps then, and the `report` task (after every stage) sends the rest, so no
    step gets two rows in MLflow (before, the monitor sent every step at DONE and the report
    sent the late points of the same steps again)."""
    import pyarrow as pa

    from shardrl.orchestrate.monitor import Monitor
    from shardrl.store import write_shard
    from shardrl.store.records import Done
    from shardrl.store.schemas import METRICS
    from shardrl.tracking.mlflow_run import client

    config = tmp_path / "run.yaml"
    config.write_text(f"extends: demo\ntracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    view = kfp_tasks.open_view(str(config), "kfp-run-2", str(tmp_path / "store"))
    clock = iter(range(1_800_000_000_000_000, 1_900_000_000_000_000))

    def chunk(worker: int, points: list[tuple[int, float]]) -> None:
        steps, values = zip(*points, strict=True)
        write_shard(view.store, view.keys.metrics_chunk("rollout", worker, next(clock)),
                    pa.table({"stage": ["rollout"] * len(points), "name": ["rollout/x"] *
                              len(points), "step": list(steps), "value": list(values),
                              "time": [1.0] * len(points)}), METRICS)

    chunk(0, [(1, 1.0), (2, 3.0)])
    chunk(1, [(1, 2.0)])
    Done(steps=2, time=1.0).write(view.store, view.keys.done())
    assert kfp_tasks.follow(view, poll_s=0.0) == 0  # the monitor task ends on DONE.json
    chunk(1, [(2, 5.0)])  # worker 1's last batch, after DONE.json
    report = Monitor(view, progress_bar=False)
    report._forward(final=True)  # what the report task's summary does first
    history = client(view.cfg).get_metric_history(report.mlflow, "rollout/x")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.5), (2, 4.0)]
