"""The `make run` demo with one seed: RL raises held-out pass@1 well past the SFT plateau."""

from __future__ import annotations

import pytest

from .conftest import run_cli, summary


@pytest.mark.slow
def test_demo_seed0_improves_heldout_pass_rate_by_ten_points(tmp_path):
    store = tmp_path / "store"
    res = run_cli(["run", "demo", "--store", str(store), "--run-id", "demo0", "--no-progress",
                   "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path,
                  timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = summary(store, "demo0")
    evals = {int(v): e for v, e in s["evals"].items()}
    baseline, final = evals[0]["pass_at_1"], evals[max(evals)]["pass_at_1"]
    assert evals[0]["prompts"] >= 256 and evals[0]["temperature"] == 1.0
    assert final - baseline >= 0.10, (baseline, final)
    assert s["accounting"]["balanced"]
    assert max(int(k) for k in s["done"]["staleness"]) <= 8
    assert s["promote"]["champion"]
