"""The snapshot stage evaluates policy v0 before publishing it, exactly as the evaluate stage
would, and the evaluate stage then owes only the later versions."""

from __future__ import annotations

import logging

from shardrl.config import load_config
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.stages.engine import PolicyEngine
from shardrl.stages.evaluate import Schedule, evaluate_version, evaluates_snapshot
from shardrl.store import LocalStore, RunKeys, read_shard
from shardrl.store.schemas import EVAL
from shardrl.tasks.source import make_task

from .conftest import run_cli


def test_the_snapshot_is_evaluated_before_it_is_published(tmp_path, tiny_config, monkeypatch):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    store_dir = tmp_path / "store"
    res = run_cli(["stage", "snapshot", "--config", str(tiny_config), "--run-id", "s",
                   "--store", str(store_dir)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    store, keys = LocalStore(store_dir), RunKeys("s")
    summary = store.get_json(keys.eval_summary(0))
    # written before the version and the run were published
    written = {k: (store_dir / k).stat().st_mtime_ns
               for k in (keys.eval_summary(0), keys.latest_policy(), keys.run_json())}
    assert written[keys.eval_summary(0)] <= written[keys.latest_policy()] <= written[keys.run_json()]
    assert store.get_json(keys.eval_latest())["version"] == 0
    assert "v0 pass@1" in res.stderr

    # the evaluate stage's own evaluation of v0 gives the same records
    cfg = load_config(str(tiny_config))
    again = StageContext(stage="evaluate", cfg=cfg, run_id="again", store=store,
                         log=logging.getLogger("test"))
    again.metrics = MetricsSink(store, again.keys, "evaluate", 0)
    for key in store.list(keys.root + "policy/v000000/"):  # the same snapshot, another run
        store.put_bytes(again.keys.root + key[len(keys.root):], store.get_bytes(key))
    try:
        ours = evaluate_version(again, PolicyEngine(again, 0), make_task(cfg), 0)
        # its metrics are stored with the evaluation, not left for the next periodic flush:
        # a stage stopped after its summary would never log them again
        assert store.list(again.keys.root + "metrics/evaluate/")
    finally:
        again.close()  # as the stage's process would at its end (its model-file cache)
    assert read_shard(store, again.keys.eval_table(0), EVAL).equals(
        read_shard(store, keys.eval_table(0), EVAL))
    when = ("seconds", "evaluated")  # how long it took and when it ended differ
    assert {k: v for k, v in ours.items() if k not in when} == \
        {k: v for k, v in summary.items() if k not in when}
    assert store.list(keys.root + "metrics/evaluate/"), "its metrics are under evaluate/"
    assert not (tmp_path / "cache" / "again").exists()

    # the evaluate stage starts at the next version it owes
    assert Schedule(store, keys, cfg.eval.every, cfg.learner.total_steps).next == cfg.eval.every


def test_a_vllm_run_leaves_v0_to_the_evaluate_stage():
    assert evaluates_snapshot(load_config("demo"))
    assert not evaluates_snapshot(load_config("demo", [
        "rollout.engine=vllm", "pipeline.resources.rollout.gpus=1",
        "pipeline.resources.evaluate.gpus=1"]))
