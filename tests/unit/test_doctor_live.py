"""Metric series from a store, and the live doctor reporting each symptom once per run."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from shardrl.config import RunConfig
from shardrl.doctor import LiveDoctor, finding_tags, load_store_metrics, saved_findings
from shardrl.doctor.series import Reducer, reduce_points, tolerant_config
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


def test_series_asked_again_as_points_arrive_match_one_built_from_scratch():
    # points arrive in rounds, as the live doctor reads them: new steps after the last, late
    # points of earlier steps (a lagging rollout shard), steps before the first, a NaN
    rounds = [
        [("learn/kl_sum", 1, 1.0), ("learn/kl_sum", 2, 2.0), ("x/adv_max", 2, 5.0)],
        [("learn/kl_sum", 3, 4.0), ("learn/kl_sum", 1, 3.0), ("x/adv_max", 2, 9.0)],
        [("learn/kl_sum", 0, 8.0), ("learn/kl_sum", 5, 1.0), ("x/adv_max", 4, math.nan)],
        [],
        [("learn/kl_sum", 4, 6.0), ("learn/kl_sum", 5, 3.0), ("x/adv_max", 4, 1.0)],
    ]
    live, seen, earlier = Reducer(), [], None
    for points in rounds:
        for p in points:
            live.add(*p)
        seen += points
        got, fresh = live.metrics(), Reducer()
        for p in seen:
            fresh.add(*p)
        want = fresh.metrics()
        for name in want.names():
            a, b = got.get(name), want.get(name)
            assert a.steps.tolist() == b.steps.tolist()
            np.testing.assert_array_equal(a.values, b.values)  # NaNs at the same steps
        if earlier is not None:  # a series handed out earlier is not changed under its holder
            assert earlier.steps.tolist() == [1, 2, 3]
        if len(seen) == 6:
            earlier = got.get("learn/kl_sum")
    kl = live.series("learn/kl_sum")
    # step 1: mean(1, 3); step 5: mean(1, 3); steps 0, 2, 3, 4 one point each
    assert kl.steps.tolist() == [0, 1, 2, 3, 4, 5]
    assert kl.values.tolist() == [8.0, 2.0, 2.0, 4.0, 6.0, 2.0]
    # x/adv_max (a maximum): step 2 the larger of 5 and 9, step 4 a mean once a NaN came in
    adv = live.series("x/adv_max")
    assert adv.values[0] == 9.0 and math.isnan(adv.values[1])


def test_series_patched_round_by_round_over_a_long_run():
    # 60 rounds of 10 new steps each plus late points up to 8 steps back: after the first
    # rounds each call patches the last series instead of rebuilding it, with the same result
    class Counting(Reducer):
        builds = 0

        def _build(self, name):
            Counting.builds += 1
            return super()._build(name)

    rng = np.random.default_rng(0)
    live, names = Counting(), ("rollout/version_lag", "learn/grad_norm_max")
    for r in range(60):
        late = rng.integers(max(0, 10 * r - 8), 10 * r + 10, 5)
        for step in [*range(10 * r, 10 * r + 10), *late.tolist()]:
            value = float(rng.normal())
            for name in names:
                live.add(name, step, value)
        live.metrics()
    assert Counting.builds <= 2 * 4  # the first rounds only
    for name in names:
        patched, built = live.series(name), live._build(name)
        assert patched.steps.tolist() == built.steps.tolist() == list(range(600))
        assert patched.values.tolist() == built.values.tolist()


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


def test_an_unreadable_chunk_is_passed_over_and_a_failing_check_does_not_raise(
        tmp_path, caplog, monkeypatch):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    write_chunk(store, keys, "rollout", "w00-1",
                [("rollout/truncation_rate", s, 0.3) for s in range(5)])
    write_chunk(store, keys, "learn", "w00-2", [("learn/grad_norm", 1, 2.0)])
    (bad,) = [k for k in store.list(keys.root + "metrics/learn/") if k.endswith(".parquet")]
    store.put_bytes(bad, store.get_bytes(bad)[:100])  # a truncated chunk
    with caplog.at_level("WARNING", logger="shardrl.doctor"):
        metrics = load_store_metrics(store, keys)
    assert "rollout/truncation_rate" in metrics and "learn/grad_norm" not in metrics
    assert "does not decode" in caplog.text and bad in caplog.text
    doctor = LiveDoctor(RunConfig(), store, keys)
    assert [f.code for f in doctor.check(5)] == ["truncation"]
    # a failure inside the check (here the state write) is logged, not raised
    write_chunk(store, keys, "prepare", "w00-3", [("prepare/advantage_abs_max", 7, 500.0)])

    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store, "put_json", refuse)
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardrl.doctor"):
        assert doctor.check(8) == []
    assert "doctor check at step 8 skipped: OSError: disk full" in caplog.text


def test_a_config_from_an_older_version_keeps_its_valid_sections():
    old = {"task": {"source": {"kind": "builtin", "name": "no-longer-a-task"}},
           "doctor": {"window": 7}, "tracking": {"enabled": False}}
    cfg = tolerant_config(old)
    assert cfg.doctor.window == 7 and not cfg.tracking.enabled and cfg.task == RunConfig().task
    assert tolerant_config({"doctor": {"window": -1}}) == RunConfig()
