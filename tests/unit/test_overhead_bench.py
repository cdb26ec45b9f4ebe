"""The overhead benchmark's measuring windows and inputs, on hand-made values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from bench import overhead_bench
from bench.overhead_bench import (
    GROUP_SIZE,
    GROUPS,
    RESPONSE,
    WARMUP,
    config_text,
    learn_bare,
    learn_bare_process,
    learn_window,
    paired_median,
    ready_shard,
    rollout_window,
    shard_prompts,
)

from shardrl.config import load_config
from shardrl.models.io import save_model
from shardrl.models.tiny import build_tiny_model, train_tokenizer
from shardrl.store.schemas import READY
from shardrl.store.shards import conform


def test_learn_window_starts_at_the_first_step_and_ends_at_done():
    points = []
    for step, logged, tokens in ((1, 10.0, 800), (2, 11.5, 700), (3, 13.0, 600)):
        points += [("learn/samples", step, 100.0, logged),
                   ("learn/samples_per_s", step, 50.0, logged),
                   ("learn/tokens", step, float(tokens), logged)]
    w = learn_window(points[::-1], done_time=14.0)  # order of the points does not matter
    # step 1 lasted 100 / 50 = 2 s, so it started at 10 - 2 = 8; DONE at 14: 6 s for all
    # 800 + 700 + 600 = 2100 tokens; from step 1's end (10) to DONE: 4 s for 700 + 600;
    # steps took 2 s, then 11.5 - 10 = 1.5 s and 13 - 11.5 = 1.5 s
    assert w == {"first_step_start": 8.0, "wall_s": 6.0, "tokens": 2100,
                 "steady_wall_s": 4.0, "steady_tokens": 1300,
                 "step_s": [2.0, 1.5, 1.5], "step_tokens": [800, 700, 600]}


def _rollout_shard(created: float, lengths: list[int], group_ids: list[str]) -> pa.Table:
    return pa.table({"created_at": [created] * len(lengths),
                     "response_token_ids": [[5] * n for n in lengths],
                     "group_id": group_ids,
                     "prompt_token_ids": [[1, len(g)] for g in group_ids]})


def test_rollout_window_leaves_the_warmup_shards_out():
    assert WARMUP == 2
    shards = [_rollout_shard(t, lengths, ["g"] * len(lengths)) for t, lengths in
              ((1.0, [8, 8]), (2.0, [8, 1]), (2.5, [3, 4]), (4.0, [8, 2]))]
    w = rollout_window(shards)
    # window from shard 1's creation (2.0) to the last one's (4.0) holds shards 2 and 3:
    # 3 + 4 + 8 + 2 = 17 tokens in 2 s; fewer than PAIRED_SHARDS shards: no paired run
    per_run = w.pop("shard_tokens_per_s")
    assert w == {"wall_s": 2.0, "tokens": 17, "tokens_per_s": 8.5, "first_shard_time": 1.0}
    assert per_run == []


def test_rollout_window_pairs_runs_of_shards(monkeypatch):
    monkeypatch.setattr(overhead_bench, "PAIRED_SHARDS", 2)
    # two shards of one generation call written 1 ms apart, then two more, then a single one
    times = (1.0, 2.0, 4.0, 4.001, 6.0, 6.001, 7.0)
    shards = [_rollout_shard(t, [5], ["g"]) for t in times]
    # runs from shard 2: shards 2-3 (10 tokens, 2.0 -> 4.001) and 4-5 (10, 4.001 -> 6.001);
    # shard 6 alone is a partial run, left out
    assert rollout_window(shards)["shard_tokens_per_s"] == pytest.approx([10 / 2.001, 10 / 2.0])


def test_paired_median_pairs_by_index():
    # ratios 10/5 = 2, 20/10 = 2, 30/60 = 0.5: median 2 (a ratio of medians would be 20/10 too,
    # but a ratio of sums would be 60/75 = 0.8)
    assert paired_median([10.0, 20.0, 30.0], [5.0, 10.0, 60.0]) == 2.0


def test_shard_prompts_gives_each_group_once_in_order():
    table = _rollout_shard(0.0, [1, 1, 1, 1], ["a", "a", "bb", "bb"])
    assert shard_prompts(table) == [[1, 1], [1, 2]]


def test_ready_shard_has_the_demo_shapes():
    table = conform(ready_shard(3, vocab=32, rng=np.random.default_rng(0)), READY)
    assert table.num_rows == GROUPS * GROUP_SIZE == 128
    groups = table.column("group_id").to_pylist()
    assert len(set(groups)) == GROUPS and groups[:GROUP_SIZE] == ["g3-0"] * GROUP_SIZE
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    assert all(5 <= len(p) <= 8 for p in prompts)
    assert all(1 <= len(r) <= RESPONSE for r in responses)
    assert [len(r) for r in responses] == [len(x) for x in
                                           table.column("behavior_logprobs").to_pylist()]
    assert all(3 <= t < 32 for r in prompts + responses for t in r)
    # rewards alternate 0, 1 in every group, so every group keeps a mixed advantage
    assert table.column("advantage").to_pylist()[:4] == [-0.5, 0.5, -0.5, 0.5]
    assert all(table.column("keep").to_pylist())


def test_config_is_the_demo_at_the_scale_without_sft(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(config_text("large", steps=10, shards=12))
    cfg = load_config(str(path))
    assert (cfg.model.source.hidden_size, cfg.model.source.num_layers) == (256, 4)
    assert not cfg.model.sft.enabled
    assert cfg.learner.total_steps == 10 and cfg.learner.max_staleness >= 10
    assert cfg.rollout.max_backlog_steps == 12 and cfg.rollout.postprocess == "stages"
    # the rest is the demo's: B=16 groups of 8, 8 prompts per shard, 8 new tokens
    assert (cfg.learner.batch_prompts, cfg.rollout.group_size) == (16, GROUP_SIZE)
    assert (cfg.rollout.prompts_per_shard, cfg.rollout.max_new_tokens) == (GROUPS, RESPONSE)


def test_bare_learner_in_a_fresh_process_makes_the_same_updates(tmp_path):
    # the cold bare loop (its own process, as the stage is) must do exactly the in-process
    # loop's work: same tokens, same final weights
    config = tmp_path / "config.yaml"
    config.write_text(config_text("demo", steps=2, shards=4))
    cfg = load_config(str(config))
    tokenizer = train_tokenizer(["abcdefghij0123456789"], tmp_path / "tok")
    folder = tmp_path / "model"
    save_model(build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                intermediate_size=16, max_position_embeddings=32, seed=0),
               tokenizer, folder)
    rng = np.random.default_rng(0)
    tables = [pa.concat_tables([ready_shard(2 * s + i, len(tokenizer), rng) for i in range(2)])
              for s in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's (and the stage's) count: equal reductions
    try:
        here = learn_bare(cfg, folder, tables)
    finally:
        torch.set_num_threads(threads)
    there = learn_bare_process(config, folder, tables, tmp_path / "work")
    assert there["tokens"] == here["tokens"] > 0
    assert len(there["step_tokens_per_s"]) == 2
    assert there["weights"].keys() == here["weights"].keys()
    for name, value in here["weights"].items():
        assert torch.equal(there["weights"][name], value), name
    # the inputs it was handed are cleaned up; its log stays
    assert not (tmp_path / "work" / "bare-learn").exists()
    assert (tmp_path / "work" / "bare-learn.log").exists()
