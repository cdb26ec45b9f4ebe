"""The report, the doctor's CLI and the sample audit on one real tiny run (with MLflow)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from e2e.conftest import TINY, run_cli

pytestmark = pytest.mark.slow

RUN = "rep1"
PLOTS = ("reward.png", "pass_rate.png", "kl_beta.png", "entropy.png", "clip_fraction.png",
         "lengths.png", "effective_sample_rate.png", "grad_norm.png", "staleness.png",
         "pass_rate_distribution.png", "scaling_fit.png")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """(work folder, store, tracking URI) of one finished tiny run: 6 steps, evals at 0, 3, 6."""
    tmp = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{tmp}/mlflow.db"
    config = tmp / "tiny.yaml"
    config.write_text(TINY + f"tracking: {{uri: '{uri}'}}\n")
    store = tmp / "store"
    res = run_cli(["run", str(config), "--store", str(store), "--run-id", RUN, "--no-progress"],
                  tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp, store, uri


def test_report_writes_every_plot_and_logs_them_to_mlflow(tiny_run):
    tmp, store, uri = tiny_run
    res = run_cli(["report", RUN, "--store", str(store)], tmp)
    assert res.returncode == 0, res.stdout + res.stderr
    out = store / "runs" / RUN / "report"
    assert f"report: {out / 'index.html'}" in res.stdout
    page = (out / "index.html").read_text()
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000, name
        assert f"src='{name}'" in page, name
    assert set(re.findall(r"src='([^']+)'", page)) == set(PLOTS)
    # three evaluations (v0, v3, v6): v0 fixes R0, two remain, fewer than the fit needs
    assert ("not enough data for the scaling fit: 2 held-out evaluation(s) past the first "
            "10% of compute, at least 6 needed") in page

    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in c.search_experiments() if e.name == "shardrl"]
    (run,) = c.search_runs([exp.experiment_id], filter_string=f"tags.`shardrl.run_id` = '{RUN}'")
    logged = {Path(a.path).name for a in c.list_artifacts(run.info.run_id, "report")}
    assert logged == set(PLOTS) | {"index.html"}
    doctor = json.loads(run_cli(["doctor", RUN, "--store", str(store), "--json"], tmp).stdout)
    assert run.data.tags["doctor.findings"] == (
        ",".join(f["code"] for f in doctor["findings"]) or "none")
    # six steps are too few for the trend rules: the page says so, as the doctor does
    found = {f["code"] for f in doctor["findings"]}
    short = {code: why for code, why in doctor["too_short"].items() if code not in found}
    assert "D" in short
    # no KL in this run: B is not assessed at all, and so not listed as not judged yet too
    assert "B" in doctor["unassessed"] and "B" not in doctor["too_short"]
    for code, why in short.items():
        assert f"<p>Not judged yet: {code} ({why})</p>" in page


def test_doctor_reads_the_same_run_from_mlflow(tiny_run, monkeypatch):
    tmp, store, uri = tiny_run
    from_store = json.loads(run_cli(["doctor", RUN, "--store", str(store), "--json"], tmp).stdout)
    assert from_store["run"] == RUN and from_store["source"].startswith("file://")

    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    (run,) = c.search_runs([e.experiment_id for e in c.search_experiments()],
                           filter_string=f"tags.`shardrl.run_id` = '{RUN}'")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    res = run_cli(["doctor", run.info.run_id, "--store", str(tmp / "no-store"), "--json"], tmp)
    assert res.returncode == 0, res.stderr
    from_mlflow = json.loads(res.stdout)
    assert from_mlflow["source"] == uri
    # the runner forwarded every metric chunk, so both sources give the same diagnosis
    assert from_mlflow["findings"] == from_store["findings"]
    assert run_cli(["doctor", "nosuchrun", "--store", str(store)], tmp).returncode == 2


def test_report_fit_only_says_not_enough_data(tiny_run):
    tmp, store, _ = tiny_run
    res = run_cli(["report", RUN, "--store", str(store), "--fit"], tmp)
    assert res.returncode == 0
    assert res.stdout.startswith("not enough data for the scaling fit: 2 held-out evaluation(s) "
                                 "past the first 10% of compute, at least 6 needed")


def test_a_report_folder_that_cannot_be_written_is_one_line(tiny_run):
    tmp, store, _ = tiny_run
    taken = tmp / "a-file"
    taken.write_text("")
    res = run_cli(["report", RUN, "--store", str(store), "--out", str(taken)], tmp)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"shardrl report: cannot write the report into {taken}: ")


def test_samples_prints_the_requested_rows(tiny_run):
    tmp, store, _ = tiny_run
    res = run_cli(["samples", RUN, "--store", str(store), "--version", "0", "--worst", "-n", "3"],
                  tmp)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert re.match(r"run rep1, policy version 0: 3 of \d+ samples \(worst\)", lines[0])
    assert lines[1].split()[:5] == ["version", "reward", "ok", "len", "finish"]
    rows = [line.split() for line in lines[3:]]
    assert len(rows) == 3 and all(r[0] == "0" for r in rows)
    rewards = [float(r[1]) for r in rows]
    assert rewards == sorted(rewards)
    assert all(0 <= int(r[3]) <= 5 for r in rows)  # lengths within max_new_tokens
    res = run_cli(["samples", RUN, "--store", str(store), "-n", "2", "--best"], tmp)
    assert len(res.stdout.splitlines()) == 3 + 2
    missing = run_cli(["samples", RUN, "--store", str(store), "--version", "999"], tmp)
    assert missing.returncode == 1 and "no scored samples for version 999" in missing.stderr
