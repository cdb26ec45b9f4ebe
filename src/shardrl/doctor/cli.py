"""`shardrl doctor RUN [--store URI] [--json]`: diagnose a run from its metric series.

RUN is a run id in the store (metrics from `metrics/<stage>/*.parquet`, thresholds from the
run's config) or, when the store has no such run, an MLflow run id (metrics from MLflow,
config from the run's params). Exit status 0 with or without findings, 2 when the run is
found nowhere.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..redact import redacted
from .findings import Finding, format_finding
from .rules import diagnose, too_short, unassessed
from .series import (
    Metrics,
    load_mlflow_metrics,
    load_store_metrics,
    mlflow_config,
    open_run,
    store_or_default,
)


@dataclass
class Diagnosis:
    run: str
    source: str
    """Where the metrics came from: the store URI or the MLflow tracking URI."""
    metrics: Metrics
    findings: list[Finding]
    cfg: RunConfig

    def to_dict(self) -> dict:
        return {"run": self.run, "source": self.source,
                "findings": [f.to_dict() for f in self.findings],
                "unassessed": unassessed(self.metrics),
                "too_short": too_short(self.metrics, self.cfg)}

    def text(self) -> str:
        learn = self.metrics.get("learn/policy_loss")
        last = int(learn.steps[-1]) if learn is not None and len(learn) else 0
        head = (f"run {self.run} ({self.source}): {len(self.metrics.names())} metric series, "
                f"learner step {last}")
        body = ([f"{len(self.findings)} finding(s):"] + [format_finding(f) for f in self.findings]
                if self.findings else ["no findings"])
        kl_off = self.cfg.algo.kl.placement == "none"
        skipped = [f"not assessed: {code} (" + (
            "no KL to a reference in this run: algo.kl.placement is none" if kl_off and
            code in ("A", "B") else f"no {', '.join(names)}") + ")"
                   for code, names in unassessed(self.metrics).items()]
        short = [f"not judged yet: {code} ({why})"
                 for code, why in too_short(self.metrics, self.cfg).items()
                 if not any(f.code == code for f in self.findings)]
        return "\n".join([head, *body, *skipped, *short])


def _mlflow_client(cfg: RunConfig):
    """An MLflow client, or None when the tracking URI is a SQLite file that does not exist
    (opening it would create an empty database)."""
    from ..tracking.mlflow_run import client, tracking_uri

    uri = tracking_uri(cfg)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return None
    return client(cfg)


def load_diagnosis(run: str, store_uri: str | None) -> Diagnosis | None:
    """Diagnose `run` from the store, else from MLflow; None when neither knows it."""
    handle = open_run(run, store_uri)
    if handle is not None:
        m = load_store_metrics(handle.store, handle.keys)
        return Diagnosis(run, handle.store.uri, m, diagnose(m, handle.cfg), handle.cfg)
    c = _mlflow_client(RunConfig())
    if c is None:
        return None
    from mlflow.exceptions import MlflowException

    try:
        cfg = mlflow_config(c, run)
        m = load_mlflow_metrics(c, run)
    except MlflowException:
        return None
    return Diagnosis(run, redacted(c.tracking_uri), m, diagnose(m, cfg), cfg)


def run(args) -> int:
    found = load_diagnosis(args.run, args.store)
    if found is None:
        where = store_or_default(args.store)
        print(f"shardrl doctor: no run {args.run!r} in the store {where!r} nor in MLflow",
              file=sys.stderr)
        return 2
    print(json.dumps(found.to_dict(), indent=2) if args.json else found.text())
    return 0
