"""`shardrl report RUN [--store URI] [--out DIR] [--fit]`: plots, findings and the scaling fit.

Writes one PNG per view of the run and `index.html` referencing them all, with the doctor's
findings and ScaleRL's compute -> pass-rate fit; logs the folder to MLflow (artifact path
`report/`) and tags the run with the findings when tracking is enabled. `--fit` prints only
the fit. The default folder is the run's `report/` in a local store, else `reports/<run>`.
"""

from __future__ import annotations

import html
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..redact import redacted
from ..store import LocalStore, RunKeys, Store, read_columns, shards_by_name
from ..store.records import Done, Progress
from .findings import Finding, finding_tags, format_finding
from .fit import NotEnoughData, ScalingFit, eval_points, fit_scaling, param_count
from .rules import diagnose, too_short, unassessed
from .series import Metrics, RunHandle, load_store_metrics, no_run, open_run

MAX_SHARDS = 400  # scored shards read for the pass-rate distribution (evenly spaced)


@dataclass
class FitResult:
    versions: np.ndarray
    compute: np.ndarray
    """Cumulative learner tokens at each evaluated version (N,)."""
    pass_rate: np.ndarray
    fit: ScalingFit | NotEnoughData
    flops_per_token: float | None
    """6 x parameters, when the parameter count is known."""

    def summary(self) -> str:
        return self.fit.summary(self.flops_per_token)


def scaling_fit(handle: RunHandle, m: Metrics) -> FitResult:
    versions, compute, rate = eval_points(m)
    d = handle.cfg.doctor
    params = param_count(handle.store, handle.keys)
    if len(rate) and m.get("learn/tokens") is None:  # every point would sit at C = 0
        fit = NotEnoughData(0, d.fit_min_points, reason="no `learn/tokens` series: the compute "
                            "behind each evaluation is unknown")
    else:
        fit = fit_scaling(compute, rate, min_points=d.fit_min_points, n_boot=d.fit_bootstrap,
                          seed=handle.cfg.seed, skip_fraction=d.fit_skip_fraction)
    return FitResult(versions, compute, rate, fit, 6.0 * params if params else None)


def staleness_histogram(store: Store, keys: RunKeys) -> dict[int, int]:
    """Admitted samples by version lag, from DONE.json or else the learner's progress."""
    done = Done.read(store, keys.done(), optional=True)
    return done.staleness if done is not None else Progress.read(store, keys.progress()).staleness


def group_pass_rates(store: Store, keys: RunKeys, max_shards: int = MAX_SHARDS
                     ) -> list[tuple[int, float]]:
    """(policy version, share of correct samples) per prompt group of the scored shards (or
    the ready shards, which hold their columns, where no scored shard was written)."""
    shard_keys = [k for _, k in sorted(shards_by_name(store, keys, ("scored", "ready")).items())]
    if len(shard_keys) > max_shards:
        shard_keys = [shard_keys[i] for i in np.linspace(0, len(shard_keys) - 1, max_shards,
                                                         dtype=int)]
    out = []
    for key in shard_keys:
        t = read_columns(store.get_bytes(key), ["group_id", "policy_version", "correct"])
        groups: dict[str, list] = {}
        for g, v, ok in zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True):
            groups.setdefault(g, [v, []])[1].append(bool(ok))
        out += [(int(v), float(np.mean(oks))) for v, oks in groups.values()]
    return out


def write_html(path: Path, run_id: str, plots: dict[str, Path], findings: list[Finding],
               not_assessed: dict[str, list[str]], fit: FitResult,
               short: dict[str, str] | None = None) -> Path:
    """The single report page: findings (and the rules this run is too short for, so that
    "no findings" is not read as a clean bill of health), the fit, then every plot."""
    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>ShardRL report: "
             f"{esc(run_id)}</title><style>body{{font-family:sans-serif;max-width:1100px;"
             f"margin:auto}} pre{{background:#f4f4f4;padding:8px;white-space:pre-wrap}} "
             f"figure{{display:inline-block;margin:6px}}</style></head><body>",
             f"<h1>ShardRL run {esc(run_id)}</h1>",
             f"<p>written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>", "<h2>Doctor</h2>"]
    if findings:
        parts += [f"<pre>{esc(format_finding(f))}</pre>" for f in findings]
    else:
        parts.append("<p>No findings.</p>")
    if not_assessed:
        parts.append("<p>Not assessed: " + "; ".join(
            f"{esc(code)} (no {esc(', '.join(names))})" for code, names in not_assessed.items())
            + "</p>")
    found = {f.code for f in findings}
    parts += [f"<p>Not judged yet: {esc(code)} ({esc(why)})</p>"
              for code, why in (short or {}).items() if code not in found]
    parts += ["<h2>Scaling fit</h2>", f"<p>{esc(fit.summary())}</p>", "<h2>Plots</h2>"]
    parts += [f"<figure><img src='{esc(p.name)}' alt='{esc(title)}'><figcaption>{esc(title)}"
              f"</figcaption></figure>" for title, p in plots.items()]
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path


def build_report(handle: RunHandle, out: Path) -> tuple[Path, list[Finding]]:
    """Write every plot and index.html into `out`; returns (index.html, findings)."""
    from . import plots as P

    out.mkdir(parents=True, exist_ok=True)
    m = load_store_metrics(handle.store, handle.keys)
    findings = diagnose(m, handle.cfg)
    fit = scaling_fit(handle, m)
    figures = P.metric_plots(out, m, handle.cfg)
    figures["Staleness of admitted samples"] = P.staleness_plot(
        out / "staleness.png", staleness_histogram(handle.store, handle.keys))
    figures["Per-prompt pass-rate distribution"] = P.pass_rate_distribution_plot(
        out / "pass_rate_distribution.png", group_pass_rates(handle.store, handle.keys))
    figures["Scaling fit"] = P.fit_plot(out / "scaling_fit.png", fit.compute, fit.pass_rate,
                                        fit.fit, fit.flops_per_token)
    index = write_html(out / "index.html", handle.keys.run_id, figures, findings, unassessed(m),
                       fit, too_short(m, handle.cfg))
    return index, findings


def log_to_mlflow(handle: RunHandle, out: Path, findings: list[Finding]) -> str:
    """Log the report folder as artifacts and the findings as tags; returns the MLflow run id."""
    from ..tracking.mlflow_run import client, find_or_create_run

    c = client(handle.cfg)
    mlflow_run = find_or_create_run(handle.cfg, handle.keys.run_id, c)
    c.log_artifacts(mlflow_run, str(out), "report")
    for key, value in finding_tags(findings).items():
        c.set_tag(mlflow_run, key, value)
    return mlflow_run


def default_out(handle: RunHandle) -> Path:
    if isinstance(handle.store, LocalStore):
        return handle.store.root.joinpath(*handle.keys.root.strip("/").split("/"), "report")
    return Path("reports") / handle.keys.run_id


def run(args) -> int:
    handle = open_run(args.run, args.store)
    if handle is None:
        print(no_run("report", args.run, args.store), file=sys.stderr)
        return 2
    if args.fit:
        print(scaling_fit(handle, load_store_metrics(handle.store, handle.keys)).summary())
        return 0
    out = Path(args.out) if args.out else default_out(handle)
    try:
        index, findings = build_report(handle, out)
    except OSError as exc:  # --out names a file, or a folder that cannot be written
        print(f"shardrl report: cannot write the report into {out}: {exc}", file=sys.stderr)
        return 1
    print(f"report: {index}  ({len(findings)} doctor finding(s))")
    if handle.cfg.tracking.enabled:
        try:
            mlflow_run = log_to_mlflow(handle, out, findings)
        except Exception as exc:  # the report stands without MLflow; say why it is not there
            print(f"report: not logged to MLflow: {redacted(str(exc))}", file=sys.stderr)
            return 1
        print(f"report: logged to MLflow run {mlflow_run} (artifacts report/)")
    return 0
