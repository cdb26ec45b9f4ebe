"""Finding or creating the MLflow run of a pipeline run, and logging to it.

SQLite takes one writer at a time: locally the runner is the only process that logs
metrics (it forwards the stages' metric chunks from the store); the promote stage writes
once, after the others stopped. Against an MLflow server any stage may write.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..config import RunConfig
from ..redact import redacted

RUN_TAG = "shardrl.run_id"




def tracking_uri(cfg: RunConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.uri


def _artifact_root(uri: str) -> str | None:
    """Artifacts beside a SQLite database (not wherever the process happens to run)."""
    parts = urlsplit(uri)
    if parts.scheme != "sqlite":
        return None
    db = Path(uri[len("sqlite:///"):]).resolve()
    return (db.parent / "mlartifacts").as_uri()


def client(cfg: RunConfig):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(cfg: RunConfig, c) -> str:
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    return c.create_experiment(cfg.tracking.experiment,
                               artifact_location=_artifact_root(tracking_uri(cfg)))


class RunIdTaken(Exception):
    """A new pipeline run's id already tags an MLflow run (of an earlier run by that id)."""


class TrackingUnavailable(Exception):
    """MLflow could not be reached or refused to open the run; the message has credentials
    masked."""


def open_run(cfg: RunConfig, run_id: str, new: bool = False):
    """(client, MLflow run id) of the pipeline run `run_id` (see `find_or_create_run`); an
    MLflow that cannot be reached or refuses is `TrackingUnavailable`, in one line."""
    try:
        c = client(cfg)
        return c, find_or_create_run(cfg, run_id, c, new=new)
    except RunIdTaken:
        raise
    except Exception as exc:  # MLflow's own errors, or its HTTP client's
        first = redacted(str(exc)).strip().splitlines()
        raise TrackingUnavailable(
            f"MLflow at {redacted(tracking_uri(cfg))} failed: {type(exc).__name__}: "
            f"{first[0] if first else ''} (start it, fix tracking.uri or MLFLOW_TRACKING_URI, "
            f"or set tracking.enabled=false)") from None


def find_or_create_run(cfg: RunConfig, run_id: str, c=None, new: bool = False) -> str:
    """The MLflow run id tagged with this pipeline run id (created with params if missing).

    `new`: the pipeline run starts from nothing, so an MLflow run tagged with its id belongs
    to an earlier run of that id (its store deleted, or another store): RunIdTaken, instead
    of mixing two runs' metrics and models in one MLflow run."""
    c = c or client(cfg)
    exp = experiment_id(cfg, c)
    found = c.search_runs([exp], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
    if found and new:
        raise RunIdTaken(
            f"shardrl run: run id {run_id} already names MLflow run {found[0].info.run_id} in "
            f"experiment {cfg.tracking.experiment!r} at {redacted(tracking_uri(cfg))}, from an "
            f"earlier "
            f"run whose store no longer holds it; pick another --run-id, or delete that MLflow "
            f"run first")
    if found:
        return found[0].info.run_id
    run = c.create_run(exp, run_name=run_id, tags={RUN_TAG: run_id,
                                                  "shardrl.config_hash": cfg.config_hash()})
    params = flatten(cfg.model_dump(mode="json"))
    from mlflow.entities import Param

    # text as it is, anything else as JSON (which reads back as YAML: `shardrl doctor` on an
    # MLflow run rebuilds the config from its params); Python's repr would not (None in a list)
    items = [Param(k, redacted(v if isinstance(v, str) else json.dumps(v))[:6000])
             for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i: i + 100])
    return run.info.run_id


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


_NOT_IN_NAMES = re.compile(r"[^\w\-. :/]")


MAX_METRIC_NAME = 250
"""MLflow's longest metric name."""


@functools.lru_cache(maxsize=4096)  # the same few names at every step of every forward
def metric_name(name: str) -> str:
    """`name` as MLflow takes it (a dataset's category, "Counting & Probability" or
    "Geometry/", is part of a name, and MLflow refuses the whole batch that holds one name it
    does not take): characters other than letters, digits, `_ - . : /` and spaces become `_`;
    as a path it must name itself, so empty and `.` parts are left out and `..` parts become
    `__`; a name longer than MLflow's limit keeps its start and a hash of the whole."""
    parts = [("__" if p == ".." else p) for p in _NOT_IN_NAMES.sub("_", name).split("/")
             if p not in ("", ".")]
    out = "/".join(parts) or "_"
    if len(out) > MAX_METRIC_NAME:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        out = f"{out[:MAX_METRIC_NAME - 9]}_{digest}"
    return out


def log_points(c, mlflow_run: str, points: list[tuple[str, int, float, float]]) -> None:
    """Log (name, step, value, time) points in batches, retrying a locked SQLite database."""
    from mlflow.entities import Metric

    metrics = [Metric(metric_name(n), v, int(t * 1000), s) for n, s, v, t in points]
    for i in range(0, len(metrics), 500):
        for attempt in range(10):
            try:
                c.log_batch(mlflow_run, metrics=metrics[i: i + 500])
                break
            except Exception as exc:  # sqlite "database is locked" under contention
                if "locked" not in str(exc) or attempt == 9:
                    raise
                time.sleep(0.2 * (attempt + 1))
