"""bench/two_process.py: the generator trains the learner one version late at most, and it
samples from the weights the learner published (two real processes, a tiny model)."""

from __future__ import annotations

import pyarrow as pa
from bench.two_process import from_bytes, run_two_process, seeds_arg, to_bytes

from shardrl.config import load_config
from shardrl.models.io import save_model
from shardrl.models.tiny import build_tiny_model, train_tokenizer
from shardrl.tasks.source import make_task

# every group is kept (no reward variance is needed for a step) and weight decay moves the
# weights at every step even where the gradient is zero, so each version has its own weights
OVERRIDES = ["algo.filters.zero_variance=false", "learner.weight_decay=0.1",
             "learner.batch_prompts=4", "rollout.prompts_per_shard=4", "rollout.group_size=2",
             "rollout.max_new_tokens=2", "task.source.heldout_size=16", "model.sft.enabled=false"]


def test_ipc_round_trip_keeps_the_table():
    table = pa.table({"a": [1, 2], "ids": [[1, 2], [3]], "text": ["x", None]})
    assert from_bytes(to_bytes(table)).equals(table)


def test_seed_ranges():
    assert seeds_arg("0-4") == [0, 1, 2, 3, 4] and seeds_arg("7") == [7]


def test_the_learner_trains_on_the_published_weights_one_version_late(tmp_path):
    cfg = load_config("demo", OVERRIDES)
    task = make_task(cfg)
    tokenizer = train_tokenizer(task.corpus + [p + a for p, a in task.demonstrations(50)],
                                tmp_path / "tok")
    snapshot = tmp_path / "policy"
    save_model(build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                intermediate_size=16, max_position_embeddings=32, seed=0),
               tokenizer, snapshot)
    result = run_two_process("demo", OVERRIDES, snapshot, budget=1.0, eval_points=2)
    assert result["steps"] >= 3
    lags = result["lags"]
    assert lags[0] == 0 and max(lags) == 1  # the first batch is v0's; later ones one behind
    # every batch was sampled from exactly the weights of the version it is labelled with
    assert result["fingerprint_mismatches"] == 0
    assert result["curve_versions"][0] == 0
    assert result["curve_versions"] == sorted(result["curve_versions"])
    assert len(result["curve"]) == len(result["curve_versions"]) >= 3
    assert all(0.0 <= p <= 1.0 for _, p in result["curve"])
