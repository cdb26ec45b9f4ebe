"""Inline post-processing: a rollout worker writes the scored and ready shards the score and
prepare stages would have written, and finishes a shard a crash left without them."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from shardrl.config import load_config
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.stages.inline import InlinePostprocess, kept_groups
from shardrl.stages.prepare import Preparer
from shardrl.stages.score import Scorer
from shardrl.store import LocalStore, RunKeys, read_shard, write_shard
from shardrl.store.schemas import READY, ROLLOUT, SCORED


def rollout_table(version: int, worker: int, seq: int) -> pa.Table:
    """Two groups of 4: the first mixed (2 right, 2 wrong), the second all wrong."""
    rows = 8
    right = [True, False, True, False, False, False, False, False]
    return pa.table({
        "prompt_id": [f"p{seq}-{i // 4}" for i in range(rows)],
        "group_id": [f"w{worker:02d}-{seq:06d}-{i // 4:03d}" for i in range(rows)],
        "sample_idx": pa.array([i % 4 for i in range(rows)], pa.int32()),
        "policy_version": pa.array([version] * rows, pa.int64()),
        "worker": pa.array([worker] * rows, pa.int32()),
        "prompt_text": ["abc="] * rows,
        "prompt_token_ids": pa.array([[1, 2, 3]] * rows, pa.list_(pa.int32())),
        "response_token_ids": pa.array([[5, 6]] * rows, pa.list_(pa.int32())),
        "behavior_logprobs": pa.array([[-0.5, -0.25]] * rows, pa.list_(pa.float32())),
        "finish_reason": ["stop"] * rows,
        "response_text": ["bcd" if r else "bce" for r in right],
        "answer": ["bcd"] * rows,
        "category": ["c"] * rows,
        "created_at": [1.7e9] * rows,
    }, schema=ROLLOUT)


def context(tmp_path, stage: str, *overrides: str) -> StageContext:
    cfg = load_config("demo", ["tracking.enabled=false", "rollout.workers=1", *overrides])
    store = LocalStore(tmp_path / "store")
    ctx = StageContext(stage=stage, cfg=cfg, run_id="r", store=store)
    ctx.metrics = MetricsSink(store, ctx.keys, stage, 0)
    return ctx


def test_inline_shards_equal_what_the_stages_write(tmp_path):
    ctx = context(tmp_path, "rollout")
    assert ctx.cfg.inline_postprocess
    table = rollout_table(3, 0, 7)
    scored, ready = InlinePostprocess(ctx).process(table)
    stage_scored = Scorer(context(tmp_path / "s", "score")).score(table)
    stage_ready = Preparer(context(tmp_path / "p", "prepare")).prepare(stage_scored)
    assert scored.equals(stage_scored) and ready.equals(stage_ready)
    # the mixed group is kept with advantages of opposite signs, the all-wrong one filtered
    assert ready.column("keep").to_pylist() == [True] * 4 + [False] * 4
    assert ready.column("correct").to_pylist()[:4] == [True, False, True, False]
    adv = ready.column("advantage").to_pylist()
    assert adv[0] > 0 > adv[1] and adv[4:] == [0.0] * 4
    assert kept_groups(ready) == 1


def test_a_rollout_shard_left_without_its_ready_shard_is_finished_on_restart(tmp_path):
    ctx = context(tmp_path, "rollout")
    store, keys = ctx.store, RunKeys("r")
    done, orphan = keys.rollout(2, 0, 4), keys.rollout(3, 0, 5)
    other_worker = keys.rollout(3, 1, 0)
    post = InlinePostprocess(ctx)
    for key in (done, orphan, other_worker):
        write_shard(store, key, rollout_table(int(key.split("/v")[1][:6]), 0, 1), ROLLOUT)
    scored, ready = post.process(read_shard(store, done, ROLLOUT))
    post.write(done, None, scored, ready, post.preparer.record(done, ready))
    assert not store.exists(keys.ready_for(orphan))  # as a kill between the writes leaves it
    restarted = InlinePostprocess(ctx)  # a new process: the preparer state from the store
    assert restarted.preparer.recent == ["w00-000004.parquet"]
    restarted.recover(last_version=3, newest=3)
    finished = read_shard(store, keys.ready_for(orphan), READY)
    assert read_shard(store, keys.scored_for(orphan), SCORED).num_rows == 8
    assert pc.sum(finished.column("keep")).as_py() == 4
    assert restarted.preparer.recent == ["w00-000004.parquet", "w00-000005.parquet"]
    # another worker's shard is that worker's to finish
    assert not store.exists(keys.ready_for(other_worker))
    # nothing is redone once finished
    restarted.recover(last_version=3, newest=3)
    assert restarted.preparer.recent == ["w00-000004.parquet", "w00-000005.parquet"]
