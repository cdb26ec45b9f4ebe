"""Metric series from a store, and the live doctor reporting each symptom once per run."""

from __future__ import annotations

import math

import pyarrow as pa

from shardrl.config import RunConfig
from shardrl.doctor import LiveDoctor, finding_tags, load_store_metrics, saved_findings
from shardrl.doctor.series import reduce_points, tolerant_config
from shardrl.store import LocalStore, RunKeys, write_shard
from shardrl.store.schemas import METRICS


def write_chunk(store, keys, stage: str, name: str, points: list[tuple[str, int, float]]):
    table = pa.table({"stage": [stage] * len(points), "name": [p[0] for p in points],
                      "step": [p[1] for p in points], "value": [p[2] for p in points],
                      "time": [0.0] * len(points)})
    write_shard(store, keys.metrics(stage, name), table, METRICS)


def test_points_reduce_to_one_value_per_step():
    # two shards at step 3: mean of 0.25 and 0.75 is 0.5; maxima keep the larger
    s = reduce_points("rollout/truncation_rate", [3, 1, 3], [0.25, 0.5, 0.75])
    assert s.steps.tolist() == [1, 3] and s.values.tolist() == [0.5, 0.5]
    m = reduce_points("prepare/advantage_abs_max", [3, 3], [2.0, 7.0])
    assert m.values.tolist() == [7.0]
    nan = reduce_points("learn/grad_norm", [1, 1], [1.0, math.nan])
    assert math.isnan(nan.values[0]) and len(nan.finite()) == 0


def test_store_metrics_from_every_stage(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    write_chunk(store, keys, "rollout", "w00-1", [("rollout/truncation_rate", 0, 0.25)])
    write_chunk(store, keys, "rollout", "w01-1", [("rollout/truncation_rate", 0, 0.75)])
    write_chunk(store, keys, "learn", "w00-1", [("learn/kl_sum", 1, 2.0), ("learn/kl_sum", 2, 3.0)])
    m = load_store_metrics(store, keys)
    assert m.names() == ["learn/kl_sum", "rollout/truncation_rate"]
    assert m.get("rollout/truncation_rate").values.tolist() == [0.5]
    assert m.get("learn/kl_sum").steps.tolist() == [1, 2]


def test_live_doctor_reports_each_symptom_once_and_survives_a_restart(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    cfg = RunConfig()
    assert LiveDoctor(cfg, store, keys).check(0) == []
    # 30% truncation for 5 steps (> 10%): the truncation alert
    write_chunk(store, keys, "rollout", "w00-1",
                [("rollout/truncation_rate", s, 0.3) for s in range(5)])
    doctor = LiveDoctor(cfg, store, keys)
    assert [f.code for f in doctor.check(5)] == ["truncation"]
    assert doctor.check(6) == []  # still true, already reported
    # |A| = 500 > 100 later on: a new symptom, reported once
    write_chunk(store, keys, "prepare", "w00-2", [("prepare/advantage_abs_max", 7, 500.0)])
    assert [f.code for f in doctor.check(8)] == ["advantage"]
    assert doctor.check(9) == []
    # a restarted learner's doctor remembers what was reported
    again = LiveDoctor(cfg, store, keys)
    assert again.check(10) == []
    saved = saved_findings(store, keys)
    assert [f.code for f in saved] == ["truncation", "advantage"]
    tags = finding_tags(saved)
    assert tags["doctor.findings"] == "truncation,advantage"
    assert tags["doctor.advantage"].startswith("advantage explosion at step 7")


def test_a_config_from_an_older_version_keeps_its_valid_sections():
    old = {"task": {"source": {"kind": "builtin", "name": "no-longer-a-task"}},
           "doctor": {"window": 7}, "tracking": {"enabled": False}}
    cfg = tolerant_config(old)
    assert cfg.doctor.window == 7 and not cfg.tracking.enabled and cfg.task == RunConfig().task
    assert tolerant_config({"doctor": {"window": -1}}) == RunConfig()
