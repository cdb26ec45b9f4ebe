"""Engineered tiny runs the doctor must diagnose: a much too large learning rate is a KL
blow-up (symptom A), a KL coefficient far too large keeps KL at zero while the reward stays
flat (symptom B).

The task is single-digit addition from a dataset, so a tiny model SFT-trained for seconds
already solves some prompts and rewards vary within groups. The runs use the PPO surrogate
and KL to the reference in the loss with a fixed beta; the base (lr 1e-4, beta 0.01) is a
healthy run whose KL grows past kl_low. Running this module as a script writes that healthy
run's metrics as the fixture of tests/unit/test_doctor_healthy.py:

    python tests/e2e/test_doctor_runs.py tests/fixtures/doctor_healthy_metrics.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if __package__:
    from .conftest import run_cli
else:  # run as a script to write the fixture
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import run_cli

pytestmark = pytest.mark.slow

BASE = """\
extends: demo
name: doctor
model:
  source: {kind: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
  sft: {demonstrations: 90, max_epochs: 30, patience: 3, batch_size: 16, lr: 1.0e-2,
        warmup_steps: 5}
task:
  source: {kind: dataset, train_path: TRAIN, eval_path: EVAL}
rollout: {prompts_per_shard: 4, group_size: 8, max_new_tokens: 3, poll_interval_s: 0.05}
learner: {total_steps: 12, batch_prompts: 4, max_staleness: 2, lr: 1.0e-4, warmup_steps: 1,
          ckpt_every: 4, poll_interval_s: 0.05}
eval: {every: 6}
algo:
  loss: {kind: ppo}
  filters: {zero_variance: false}
  kl: {placement: loss, controller: {kind: fixed, beta: 0.01}}
tracking: {enabled: false}
"""


def write_config(folder: Path) -> Path:
    """The base config and its dataset (all 100 sums a+b of digits; 32 of them held out)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rows = rows[::7] + [r for i, r in enumerate(rows) if i % 7]  # a fixed mix of both operands
    train, heldout = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    config = folder / "doctor.yaml"
    config.write_text(BASE.replace("TRAIN", str(train)).replace("EVAL", str(heldout)))
    return config


def run_and_diagnose(folder: Path, run_id: str, *overrides: str) -> dict:
    """Run the base config with `overrides` (`key=value`) and return `shardrl doctor --json`."""
    config, store = write_config(folder), folder / "store"
    sets = [a for o in overrides for a in ("--set", o)]
    res = run_cli(["run", str(config), "--store", str(store), "--run-id", run_id,
                   "--no-progress", *sets], folder)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = run_cli(["doctor", run_id, "--store", str(store), "--json"], folder)
    assert doc.returncode == 0, doc.stderr
    return json.loads(doc.stdout)


def test_much_too_large_learning_rate_is_a_kl_blowup(tmp_path):
    report = run_and_diagnose(tmp_path, "lr", "learner.lr=0.1")  # 1000x the base
    codes = [f["code"] for f in report["findings"]]
    assert "A" in codes and "B" not in codes, report
    a = report["findings"][codes.index("A")]
    assert a["remedies"][0]["keys"] == ["learner.lr"]
    assert [e["metric"] for e in a["evidence"]][1:] == ["learn/clip_frac", "learn/entropy"]


def test_far_too_large_kl_beta_keeps_kl_at_zero_and_reward_flat(tmp_path):
    report = run_and_diagnose(tmp_path, "beta", "algo.kl.controller.beta=100")  # 10^4 x
    codes = [f["code"] for f in report["findings"]]
    assert "B" in codes and "A" not in codes, report
    b = report["findings"][codes.index("B")]
    assert b["remedies"][0]["keys"] == ["algo.kl.controller.beta"]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        healthy = run_and_diagnose(work, "healthy")
        assert healthy["findings"] == [], healthy
        import pyarrow.parquet as pq

        points = []
        for chunk in sorted((work / "store" / "runs" / "healthy" / "metrics").rglob("*.parquet")):
            t = pq.read_table(chunk, columns=["name", "step", "value"])
            points += [list(p) for p in zip(*(t.column(c).to_pylist() for c in t.column_names),
                                            strict=True)]
        head = json.dumps({"about": "metrics (name, step, value) of the healthy base run of "
                                    "tests/e2e/test_doctor_runs.py", "config": BASE})
        Path(sys.argv[1]).write_text(head[:-1] + ', "points": [\n'
                                     + ",\n".join(json.dumps(p) for p in points) + "\n]}\n")
