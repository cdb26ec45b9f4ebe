"""The Kubeflow pipelines' own tasks besides the stages: `monitor` and `report`.

- `monitor` (async pipeline, beside the stages): forwards the stages' metric chunks from the
  store to MLflow while the run goes, with the local runner's forwarder (`Monitor`), and prints
  a progress line; it ends when the learner writes DONE.json.
- `report` (both pipelines, after promote): forwards what is left, logs the closing summary,
  links the MLflow run and the KFP run both ways (MLflow tags `kfp.run_id`, `kfp.run_url`; the
  report links the MLflow run), and writes the task's two output artifacts, which the KFP UI
  shows: a Metrics artifact (final pass@1, steps, the accounting) and an HTML artifact (the
  run's summary). KFP takes a Metrics artifact's values from its metadata, which a container
  writes into the executor output file named in the executor input (`{{$}}`).

Run as `python -m shardrl.orchestrate.kfp_tasks monitor|report --config C --run-id R --store S
[...]`: the command lines of the pipeline tasks.
"""

from __future__ import annotations

import argparse
import html
import json
import time
from pathlib import Path
from types import SimpleNamespace

RUN_URL_TAG = "kfp.run_url"
RUN_ID_TAG = "kfp.run_id"


def open_view(config: str, run_id: str, store_uri: str | None) -> SimpleNamespace:
    """What `Monitor` reads of a run: its config, store, keys and id. Never a new run
    (`new`): the pipeline's tasks, retried or not, find its MLflow run or make it."""
    from ..stages.context import load_stage_config, retry_policy
    from ..store import RunKeys, open_store

    cfg = load_stage_config(config, [])
    store = open_store(store_uri or cfg.store.uri, retry_policy(cfg))
    return SimpleNamespace(cfg=cfg, store=store, keys=RunKeys(run_id), run_id=run_id,
                           log_dir="(the pipeline tasks' logs)", new=False)


def run_url(cfg, run_id: str) -> str | None:
    """The KFP UI's page of the run, when `pipeline.ui_endpoint` is known."""
    base = cfg.pipeline.ui_endpoint
    return f"{base.rstrip('/')}/#/runs/details/{run_id}" if base else None


def mlflow_url(tracking: str, experiment_id: str, mlflow_run: str) -> str | None:
    """The MLflow UI's page of a run, for a tracking server reached over HTTP."""
    if not tracking.startswith(("http://", "https://")):
        return None
    return f"{tracking.rstrip('/')}/#/experiments/{experiment_id}/runs/{mlflow_run}"


def link_runs(monitor, view) -> str | None:
    """Tag the MLflow run with the KFP run (id and URL); return the MLflow run's URL."""
    if monitor.mlflow is None:
        return None
    from ..tracking.mlflow_run import redacted, tracking_uri

    url = run_url(view.cfg, view.run_id)
    monitor.client.set_tag(monitor.mlflow, RUN_ID_TAG, view.run_id)
    if url:
        monitor.client.set_tag(monitor.mlflow, RUN_URL_TAG, url)
    run = monitor.client.get_run(monitor.mlflow)
    return mlflow_url(redacted(tracking_uri(view.cfg)), run.info.experiment_id, monitor.mlflow)


def follow(view, poll_s: float = 10.0) -> int:
    """Forward metrics to MLflow until DONE.json, or ABORTED.json when a stage failed for good
    (the `monitor` task). At DONE.json the rollout workers (and score and prepare) may still
    log their last batch's points: only settled steps go here, and the `report` task, which
    runs after every stage and this one, sends the rest. An aborted run has no report task
    to come: everything read goes at once."""
    from .monitor import Monitor

    monitor = Monitor(view, progress_bar=False)
    link_runs(monitor, view)
    while not (view.store.exists(view.keys.done()) or view.store.exists(view.keys.aborted())):
        monitor.tick()
        time.sleep(poll_s)
    monitor.finish_metrics(final=view.store.exists(view.keys.aborted()))
    return 0


def kfp_metrics(summary: dict) -> dict[str, float]:
    """The numbers the KFP UI shows for the run, from the runner's `summary.json`."""
    out: dict[str, float] = {"steps": float(summary["done"]["steps"])}
    evals = {int(k): v for k, v in summary.get("evals", {}).items()}
    if 0 in evals:  # the snapshot's version: the baseline (the local summary's too)
        out["pass_at_1_baseline"] = float(evals[0]["pass_at_1"])
    if evals:
        out["pass_at_1_final"] = float(evals[max(evals)]["pass_at_1"])
        out["final_version"] = float(max(evals))
    for name, value in summary.get("accounting", {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"samples_{name}"] = float(value)
    promo = summary.get("promote") or {}
    if isinstance(promo.get("model_version"), int | str) and str(promo["model_version"]).isdigit():
        out["registered_version"] = float(promo["model_version"])
    return out


def report_html(run_id: str, summary: dict, metrics: dict[str, float],
                links: dict[str, str | None]) -> str:
    """A self-contained page (the KFP UI shows it in a frame): links, numbers, promotion."""
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{v:g}</td></tr>" for k, v in metrics.items())
    anchors = "".join(f"<li>{esc(name)}: <a href='{esc(url)}' target='_blank'>{esc(url)}</a>"
                      f"</li>" for name, url in links.items() if url)
    promo = summary.get("promote") or {}
    if promo.get("model_version") is not None:
        promoted = (f"<p>Registered {esc(str(promo.get('model_name')))} "
                    f"v{esc(str(promo.get('model_version')))} (policy "
                    f"v{esc(str(promo.get('version')))}"
                    f"{', champion' if promo.get('champion') else ', challenger only'})</p>"
                    + (f"<p>{esc(promo['champion_kept'])}</p>" if promo.get("champion_kept")
                       else ""))
    elif promo:  # tracking off
        promoted = (f"<p>Chose policy v{esc(str(promo.get('version')))}; tracking is off, so "
                    "no model was registered.</p>")
    else:
        promoted = "<p>No model was registered.</p>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>ShardRL run "
            f"{esc(run_id)}</title></head><body><h1>ShardRL run {esc(run_id)}</h1>"
            f"<ul>{anchors}</ul>{promoted}<table border='1' cellpadding='4'>"
            f"<tr><th>metric</th><th>value</th></tr>{rows}</table></body></html>")


def write_outputs(executor_input: str, metrics_path: str, html_path: str,
                  metrics: dict[str, float], page: str) -> None:
    """The Metrics artifact (its file and, for the UI, its metadata in the executor output)
    and the HTML artifact."""
    for path, text in ((metrics_path, json.dumps(metrics, indent=1)), (html_path, page)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    outputs = json.loads(executor_input)["outputs"]
    output_file = Path(outputs["outputFile"])
    output_file.parent.mkdir(parents=True, exist_ok=True)
    output_file.write_text(json.dumps({"artifacts": {
        "metrics": {"artifacts": [{"metadata": metrics}]},
    }}))


def report(view, executor_input: str, metrics_path: str, html_path: str) -> int:
    """The `report` task: the closing summary, the run links and the KFP output artifacts."""
    from .monitor import Monitor

    monitor = Monitor(view, progress_bar=False)
    mlflow_link = link_runs(monitor, view)
    code = monitor.summary()
    summary = view.store.get_json(view.keys.state("runner", "summary.json"))
    metrics = kfp_metrics(summary)
    links = {"MLflow run": mlflow_link, "Kubeflow run": run_url(view.cfg, view.run_id)}
    write_outputs(executor_input, metrics_path, html_path, metrics,
                  report_html(view.run_id, summary, metrics, links))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardrl.orchestrate.kfp_tasks")
    parser.add_argument("task", choices=("monitor", "report"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--store", default=None)
    parser.add_argument("--executor-input", help="report: KFP's executor input (JSON)")
    parser.add_argument("--metrics", help="report: path of the Metrics artifact")
    parser.add_argument("--html", help="report: path of the HTML artifact")
    args = parser.parse_args(argv)
    from ..quiet import quiet_libraries

    quiet_libraries()  # as `shardrl` itself: no usage reports
    view = open_view(args.config, args.run_id, args.store)
    if args.task == "monitor":
        return follow(view)
    if not (args.executor_input and args.metrics and args.html):
        parser.error("report needs --executor-input, --metrics and --html")
    return report(view, args.executor_input, args.metrics, args.html)


if __name__ == "__main__":
    from shardrl.cli import run_and_leave

    run_and_leave(main)  # the monitor's last act reads metric chunks: no teardown (`leave`)
