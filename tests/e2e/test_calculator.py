"""The calculator preset, briefly, through the local pipeline: multi-turn episodes with tool
calls reach the learner with their policy mask, and the accounting holds exactly."""

from __future__ import annotations

import pyarrow.parquet as pq

from .conftest import run_cli, summary

SHORT = """\
extends: calculator
name: calc-e2e
model:
  sft: {demonstrations: 200, max_epochs: 20, patience: 2}
task:
  source: {kind: builtin, name: calculator, demo_error_rate: 0.3, heldout_size: 32}
  environment: calculator
rollout: {prompts_per_shard: 4, group_size: 4, poll_interval_s: 0.05}
learner: {total_steps: 4, batch_prompts: 4, max_staleness: 2, warmup_steps: 1, ckpt_every: 1,
          poll_interval_s: 0.05}
eval: {every: 2}
algo: {filters: {zero_variance: false}}
tracking: {enabled: false}
promote: {model_name: calc-e2e}
"""


def test_calculator_preset_runs_episodes_with_exact_accounting(tmp_path):
    cfg = tmp_path / "calc.yaml"
    cfg.write_text(SHORT)
    store = tmp_path / "store"
    res = run_cli(["run", str(cfg), "--store", str(store), "--run-id", "calc", "--no-progress"],
                  tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = summary(store, "calc")
    acc = s["accounting"]
    assert acc["balanced"] and acc["generated"] > 0 and acc["consumed"] > 0
    assert acc["generated"] == (acc["consumed"] + acc["stale_dropped"] + acc["filtered"]
                                + acc["quarantined"] + acc["unconsumed"])
    assert (store / "runs" / "calc" / "DONE.json").exists()
    assert {0, 4} <= {int(v) for v in s["evals"]}

    rows = [r for f in sorted((store / "runs" / "calc" / "ready").rglob("*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    assert len(rows) == acc["generated"]
    tool_calls = 0
    for r in rows:
        mask, ids = r["policy_mask"], r["response_token_ids"]
        assert len(mask) == len(ids) == len(r["behavior_logprobs"])
        assert r["turn_starts"][0] == 0 and len(r["turn_starts"]) == len(r["turn_rewards"]) <= 3
        assert all(mask[i] == 1 for i in r["turn_starts"])  # each turn opens with the policy
        # the environment's tokens carry no behaviour logprob
        assert all(lp == 0.0 for lp, m in zip(r["behavior_logprobs"], mask, strict=True) if not m)
        assert r["reward_rm"] == sum(r["turn_rewards"]) and r["correct"] == (r["reward_rm"] >= 1)
        tool_calls += 0 in mask
    assert tool_calls >= len(rows) // 10, tool_calls  # the SFT start calls the tool
