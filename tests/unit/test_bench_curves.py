"""The peer comparisons' arithmetic (bench/curves.py, bench/trl_bench.py, the table of
bench/run_all.py) on hand-computed cases."""

from __future__ import annotations

import math
import random

import pytest
from bench.curves import (
    binomial_se,
    bootstrap_interval,
    gain_curve,
    idle_together,
    intersect,
    machine_share,
    mean_curve,
    percentile,
    pooled_time_to_gain,
    ratio,
    samples_between,
    spread,
    steady_samples_per_s,
    steps_per_s,
    target_pass,
    time_to_reach,
    time_to_reach_interpolated,
    time_to_target,
    union,
    value_at,
    values_at,
)
from bench.run_all import _demo, _spread, _trl
from bench.trl_bench import (
    MACHINE_STAGES,
    choose_baseline,
    compare,
    compare_sync,
    cpu_per_step,
    last_per_writer,
    learner_waits,
    pipeline_figures,
    pooled,
    pooled_interval,
    rollout_pauses,
    summarize,
)

SHARDRL = [(0.0, 0.5), (10.0, 0.6), (20.0, 0.8), (40.0, 0.9)]
TRL = [(0.0, 0.5), (30.0, 0.7), (60.0, 0.75)]
SYNC = [(0.0, 0.5), (15.0, 0.55), (30.0, 0.65), (45.0, 0.6)]


# -- targets -------------------------------------------------------------------------------
def test_target_is_seventy_percent_of_the_gain_over_the_snapshot():
    assert target_pass(0.5, 0.75) == pytest.approx(0.675)  # 0.5 + 0.7 x 0.25
    assert target_pass(0.2, 0.7, fraction=0.5) == pytest.approx(0.45)
    assert target_pass(0.5, 0.5) is None  # no gain: no target
    assert target_pass(0.5, 0.4) is None


def test_time_to_target_uses_the_reference_curve_and_first_measured_times():
    got = time_to_target(TRL, SHARDRL)
    # TRL: v0 0.5, best 0.75 -> target 0.675; TRL first >= 0.675 at 30 s (0.7), ShardRL at
    # 20 s (0.6 at 10 s is short)
    assert got["v0"] == 0.5 and got["best"] == 0.75
    assert got["target"] == pytest.approx(0.675)
    assert got["seconds"] == [30.0, 20.0]
    # a curve that never gets there
    assert time_to_target(TRL, [(0.0, 0.5), (50.0, 0.67)])["seconds"] == [30.0, None]
    # a reference that gained nothing has no target: no times at all
    flat = [(0.0, 0.5), (10.0, 0.5), (20.0, 0.45)]
    assert time_to_target(flat, SHARDRL) == {"v0": 0.5, "best": 0.5, "target": None,
                                             "seconds": [None, None],
                                             "crossing": [None, None]}


def test_interpolated_crossing_reads_the_line_between_evaluations():
    # SHARDRL crosses 0.675 between (10, 0.6) and (20, 0.8): 10 + 10 x 0.075 / 0.2 = 13.75
    assert time_to_reach_interpolated(SHARDRL, 0.675) == pytest.approx(13.75)
    # TRL between (0, 0.5) and (30, 0.7): 30 x 0.175 / 0.2 = 26.25
    assert time_to_reach_interpolated(TRL, 0.675) == pytest.approx(26.25)
    # a point exactly on the target is its own crossing; the start counts when already there
    assert time_to_reach_interpolated(SHARDRL, 0.8) == pytest.approx(20.0)
    assert time_to_reach_interpolated(SHARDRL, 0.5) == 0.0
    # a dip after a crossing does not move it; never reached: None
    assert time_to_reach_interpolated([(0.0, 0.5), (10.0, 0.9), (20.0, 0.6)], 0.7) == pytest.approx(5.0)
    assert time_to_reach_interpolated(TRL, 0.76) is None
    # first crossing, not the last: 0.5 -> 0.7 (crosses 0.65 at 7.5), 0.6, then 0.8
    assert time_to_reach_interpolated([(0.0, 0.5), (10.0, 0.7), (20.0, 0.6), (30.0, 0.8)],
                                      0.65) == pytest.approx(7.5)
    got = time_to_target(TRL, SHARDRL)
    assert got["crossing"] == [pytest.approx(26.25), pytest.approx(13.75)]


def test_time_to_reach_counts_equal_as_reached():
    assert time_to_reach(SHARDRL, 0.8) == 20.0
    assert time_to_reach(SHARDRL, 0.8 + 1e-12) == 20.0  # float noise of a computed target
    assert time_to_reach(SHARDRL, 0.95) is None


def test_compare_adds_the_target_time_ratio():
    got = compare(SHARDRL, TRL)
    assert got["target"] == pytest.approx(0.675)
    assert got["trl_seconds_to_target"] == 30.0 and got["shardrl_seconds_to_target"] == 20.0
    assert got["target_time_ratio"] == pytest.approx(20 / 30)
    # the existing figures are unchanged: 20 s to TRL's final 0.75 over TRL's 60 s
    assert got["time_ratio"] == pytest.approx(1 / 3)
    assert got["pass_gap"] == pytest.approx(0.15)
    never = compare([(0.0, 0.5), (10.0, 0.55), (60.0, 0.6)], TRL)
    assert never["target_time_ratio"] is None and never["time_ratio"] is None


def test_compare_sync_speedup_and_sample_rates():
    shardrl = {"curve": SHARDRL, "steady_samples_per_s": 300.0, "samples_per_s": 250.0}
    sync = {"curve": SYNC, "steady_samples_per_s": 200.0, "samples_per_s": 125.0}
    got = compare_sync(shardrl, sync)
    # sync: v0 0.5, best 0.65 -> target 0.605; sync first >= 0.605 at 30 s, ShardRL at 20 s
    assert got["target"] == pytest.approx(0.605)
    assert got["sync_seconds_to_target"] == 30.0 and got["shardrl_seconds_to_target"] == 20.0
    assert got["time_speedup"] == pytest.approx(1.5)
    # crossings: sync between (15, 0.55) and (30, 0.65): 15 + 15 x 0.055 / 0.1 = 23.25;
    # ShardRL between (10, 0.6) and (20, 0.8): 10 + 10 x 0.005 / 0.2 = 10.25
    assert got["sync_crossing_s"] == pytest.approx(23.25)
    assert got["shardrl_crossing_s"] == pytest.approx(10.25)
    assert got["time_speedup_interpolated"] == pytest.approx(23.25 / 10.25)
    assert got["samples_per_s_ratio"] == pytest.approx(1.5)  # steady: 300 / 200
    assert got["samples_per_s_ratio_whole_run"] == pytest.approx(2.0)  # 250 / 125
    slow = compare_sync({**shardrl, "curve": [(0.0, 0.5), (40.0, 0.6)],
                         "steady_samples_per_s": None}, sync)
    assert slow["time_speedup"] is None and slow["samples_per_s_ratio"] is None
    # without CPU figures the ratio is undefined; with them, ShardRL's total over sync's
    assert got["cpu_per_step_ratio"] is None
    cpu = compare_sync({**shardrl, "cpu_per_step": {"total": 0.3}, "samples": 600, "steps": 2},
                       {**sync, "cpu_per_step": {"total": 0.2}, "samples": 500, "steps": 2})
    assert cpu["cpu_per_step_ratio"] == pytest.approx(1.5)
    assert cpu["samples_per_step"] == {"shardrl": 300.0, "sync": 250.0}


def test_steps_per_s_between_two_versions():
    times = {1: 0.5, 2: 0.6, 30: 3.4}
    assert steps_per_s(times, 1, 30) == pytest.approx(29 / 2.9)  # 10 steps/s
    assert steps_per_s(times, 2, 30) == pytest.approx(28 / 2.8)
    assert steps_per_s(times, 1, 40) is None  # version 40 never published
    assert steps_per_s({1: 1.0, 30: 1.0}, 1, 30) is None  # no time between them
    assert steps_per_s(times, 30, 1) is None


def test_compare_sync_takes_the_speedup_apart_into_step_rate_and_steps_needed():
    # ShardRL: versions 1 and 30 published at 1.0 s and 3.9 s (keys as strings, as after a
    # trip through JSON): 29 / 2.9 = 10 steps/s; sync: version k at 2.0 + 0.2 (k - 1) s, so
    # version 30 at 7.8 s: 29 / 5.8 = 5 steps/s; ratio 2
    shardrl = {"curve": SHARDRL, "samples_per_s": 1.0, "version_times": {"1": 1.0, "30": 3.9},
               "version_curve": [(0.0, 0.5), (10.0, 0.6), (20.0, 0.8), (40.0, 0.9)]}
    sync = {"curve": SYNC, "samples_per_s": 1.0, "curve_versions": [0, 6, 14, 20],
            "step_times": [2.0 + 0.2 * i for i in range(30)]}
    got = compare_sync(shardrl, sync)
    assert got["early_steps_per_s"] == {"shardrl": pytest.approx(10.0),
                                        "sync": pytest.approx(5.0)}
    assert got["early_steps_per_s_ratio"] == pytest.approx(2.0)
    # the target 0.605 (sync's): sync's (version, pass@1) points (6, 0.55) and (14, 0.65)
    # give 6 + 8 x 0.055 / 0.1 = 10.4; ShardRL's (10, 0.6) and (20, 0.8) give
    # 10 + 10 x 0.005 / 0.2 = 10.25
    assert got["versions_to_target"] == {"shardrl": pytest.approx(10.25),
                                         "sync": pytest.approx(10.4)}
    assert got["versions_to_target_ratio"] == pytest.approx(10.4 / 10.25)
    # without the figures (older results), both are undefined
    bare = compare_sync({"curve": SHARDRL, "samples_per_s": 1.0},
                        {"curve": SYNC, "samples_per_s": 1.0})
    assert bare["early_steps_per_s_ratio"] is None
    assert bare["versions_to_target"] == {"shardrl": None, "sync": None}
    assert bare["versions_to_target_ratio"] is None


def test_cpu_per_step_splits_shardrls_cpu_by_kind_of_work():
    # cumulative counters: the newest point of each process counts, whatever the order
    points = [("rollout/w00", "rollout/sampling_cpu_s", 3, 3.0, 5.0),
              ("rollout/w00", "rollout/sampling_cpu_s", 1, 2.0, 1.0),
              ("rollout/w01", "rollout/sampling_cpu_s", 2, 2.5, 4.0),
              ("learn/w00", "learn/busy_cpu_s", 9, 4.0, 6.0),
              ("learn/w00", "learn/busy_cpu_s", 8, 3.5, 5.5)]
    cpu_s = {"snapshot": 3.0, "rollout": 10.0, "learn": 5.0, "evaluate": 1.0}
    got = cpu_per_step(cpu_s, points, 10)
    # RL-phase processes 16 s (not the snapshot) over 10 steps; sampling 3 + 2.5, updates 4
    assert got == pytest.approx({"total": 1.6, "generate": 0.55, "update": 0.4,
                                 "evaluate": 0.1, "rest": 0.55})
    assert cpu_per_step(cpu_s, points[:3], 10) is None  # no learner counter
    assert cpu_per_step(None, points, 10) is None and cpu_per_step(cpu_s, points, 0) is None


def test_ratio_is_undefined_without_both_numbers():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None


# -- medians over repeats ------------------------------------------------------------------
def test_spread_leaves_out_undefined_values():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                             "undefined": 1}
    assert spread([1.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "undefined": 0}
    assert spread([None]) == {"median": None, "min": None, "max": None, "undefined": 1}


def test_spread_counts_never_reached_as_the_worst_value():
    # a time ratio (lower is better): a never-reached repeat sorts above every number
    assert spread([0.5, None, 0.7], "high") == {"median": 0.7, "min": 0.5, "max": None,
                                               "undefined": 1}
    assert spread([None, None, 0.7], "high")["median"] is None
    # a speedup (higher is better): it sorts below every number
    assert spread([1.5, None, 2.0], "low") == {"median": 1.5, "min": None, "max": 2.0,
                                              "undefined": 1}
    # an even count: the mean of the middle two, undefined if one of them is
    assert spread([1.0, 2.0, 4.0, None], "high")["median"] == 3.0
    assert spread([1.0, None], "high")["median"] is None
    with pytest.raises(ValueError):
        spread([1.0], "sideways")


def test_binomial_standard_error():
    assert binomial_se(0.9, 256) == pytest.approx(0.01875)  # sqrt(0.09 / 256) = 0.3 / 16
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert binomial_se(1.0, 10) == 0.0
    with pytest.raises(ValueError):
        binomial_se(0.5, 0)


# -- steady state, percentiles, machine share ----------------------------------------------
def test_steady_samples_per_s_counts_samples_between_first_and_last_version():
    events = [(9.0, 64), (10.0, 64), (11.0, 64), (15.0, 128), (20.0, 64), (21.0, 64)]
    # versions at 10, 12 and 20 s (any order): samples finished in (10, 20] are
    # 64 + 128 + 64 = 256 over 10 s
    assert steady_samples_per_s([20.0, 10.0, 12.0], events) == pytest.approx(25.6)
    assert samples_between(events, 10.0, 20.0) == 256
    assert steady_samples_per_s([10.0], events) is None
    assert steady_samples_per_s([10.0, 10.0], events) is None


def test_percentile_interpolates_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # 3 + 0.85 x (4 - 3)
    assert percentile([5.0], 95) == 5.0
    assert percentile([], 50) is None


def test_machine_share_sums_the_rl_stages_present():
    cpu_s = {"rollout": 50.0, "learn": 60.0, "evaluate": 10.0, "runner": 5.0, "snapshot": 7.0}
    # score and prepare absent (run inside rollout): (50 + 60 + 10) / (2 cores x 80 s)
    assert machine_share(cpu_s, MACHINE_STAGES, 2, 80.0) == pytest.approx(0.75)
    assert machine_share({"runner": 5.0}, MACHINE_STAGES, 2, 80.0) is None
    assert machine_share(cpu_s, MACHINE_STAGES, 2, 0.0) is None


# -- ShardRL's run metrics ------------------------------------------------------------------
def _points() -> list[tuple[str, str, int, float, float]]:
    points = [("learn/w00", "learn/update_s", step, 0.5, t)
              for step, t in ((1, 100.0), (1, 101.0), (2, 105.0), (3, 110.0))]
    points += [("rollout/w00", "rollout/samples", 0, 64.0, t)
               for t in (99.0, 102.0, 106.0, 110.0, 112.0)]
    points += [("learn/w00", "learn/hop_s", s, v, 100.0 + s)
               for s, v in enumerate([0.5, 0.1, 0.4, 0.2, 0.3])]
    points += [("learn/w00", "learner/hop_max_s", s, v, 100.0 + s)
               for s, v in enumerate([0.9, 1.5, 0.6])]
    points += [("rollout/w00", "rollout/busy_fraction", 1, 0.5, 100.0),
               ("rollout/w00", "rollout/busy_fraction", 3, 0.9, 110.0),
               ("rollout/w01", "rollout/busy_fraction", 3, 0.7, 108.0),
               ("learn/w00", "learn/busy_fraction", 2, 0.6, 105.0),
               ("learn/w00", "learn/busy_fraction", 3, 0.85, 110.0)]
    return points[::-1]  # the order of the points does not matter


def test_pipeline_figures_from_hand_made_metrics():
    got = pipeline_figures(_points())
    # version 1 published at 100 (its re-log at 101 is a skipped step), version 3 at 110:
    # samples in (100, 110] are 3 x 64 over 10 s
    assert got["steady_samples_per_s"] == pytest.approx(19.2)
    # rollout: newest value per worker, 0.9 and 0.7, averaged; learner: its newest
    assert got["busy_fraction"] == {"rollout": pytest.approx(0.8), "learner": 0.85}
    # per-step median hops 0.1..0.5: p50 0.3, p95 at position 3.8: 0.4 + 0.8 x 0.1; the
    # largest per-step maximum 1.5 (either namespace counts)
    assert got["hop_s"] == {"p50": pytest.approx(0.3), "p95": pytest.approx(0.48),
                            "max": 1.5, "n": 5}


def test_pipeline_figures_tolerate_missing_metrics():
    assert pipeline_figures([]) == {
        "steady_samples_per_s": None, "busy_fraction": {"rollout": None, "learner": None},
        "steady_busy_fraction": {"rollout": None, "rollout_generating": None, "learner": None,
                                 "learner_cpu": None},
        "hop_s": {"p50": None, "p95": None, "max": None, "n": 0},
        "resume_lag_s": {"p50": None, "p95": None, "n": 0},
        "profile": {"learn/update_s": None, "learn/commit_s": None, "learn/read_s": None,
                    "learn/wait_s": None, "rollout/generate_s": None, "rollout/post_s": None},
        "idle_together": None, "early": {}}
    assert last_per_writer([]) is None


# -- summary over repeats and the table ------------------------------------------------------
def _row(target_time_ratio: float | None, speedup: float | None, final: float) -> dict:
    side = {"final_pass": final, "best_pass": final, "samples_per_s": 100.0,
            "steady_samples_per_s": 120.0, "seconds": 60.0, "steps": 60}
    return {
        "time_ratio": None, "pass_gap": 0.0, "samples_per_s_ratio": 1.2,
        "target_time_ratio": target_time_ratio, "target": 0.8,
        "vs_sync": {"time_speedup": speedup, "samples_per_s_ratio": 1.3,
                    "samples_per_s_ratio_whole_run": 1.4, "target": 0.7,
                    "early_steps_per_s": {"shardrl": 10.0 * final, "sync": 6.0},
                    "early_steps_per_s_ratio": 10.0 * final / 6.0,
                    "versions_to_target": {"shardrl": None if speedup is None else 20.0,
                                           "sync": 15.0},
                    "versions_to_target_ratio": None if speedup is None else 0.75},
        "shardrl": side | {"eval_samples": 256, "machine_share": None, "curve": SHARDRL,
                           "cpu_per_step": {"total": final / 3, "update": 0.1},
                           "busy_fraction": {"rollout": 0.9, "learner": None},
                           "hop_s": {"p50": None, "p95": None, "n": 0}},
        "trl": side | {"curve": TRL}, "sync": side | {"curve": SYNC},
    }


def test_summarize_medians_never_reached_and_standard_errors():
    rows = [_row(0.4, 2.0, 0.9), _row(None, None, 0.8), _row(0.6, 1.5, 0.85)]
    out = summarize(rows)
    # never reached is the worst: the time ratio's median is 0.6, the speedup's 1.5
    assert out["target_time_ratio"] == {"median": 0.6, "min": 0.4, "max": None, "undefined": 1}
    assert out["vs_sync"]["time_speedup"] == {"median": 1.5, "min": None, "max": 2.0,
                                              "undefined": 1}
    assert out["shardrl"]["final_pass"]["median"] == 0.85
    assert out["eval_samples"] == 256
    assert out["shardrl"]["final_pass_se"] == pytest.approx(math.sqrt(0.85 * 0.15 / 256))
    assert out["machine_share"]["median"] is None  # not recorded by the pipeline
    assert out["busy_fraction"]["rollout"]["median"] == 0.9
    cpu = out["cpu_per_step"]
    assert cpu["shardrl"]["total"]["median"] == pytest.approx(0.85 / 3)
    assert cpu["shardrl"]["update"]["median"] == 0.1
    assert cpu["shardrl"]["rest"]["undefined"] == 3  # a part a run did not report
    assert cpu["sync"]["total"]["median"] is None
    vs = out["vs_sync"]
    assert vs["early_versions"] == [1, 30]
    assert vs["early_steps_per_s"]["shardrl"]["median"] == pytest.approx(8.5)
    assert vs["early_steps_per_s_ratio"]["median"] == pytest.approx(8.5 / 6.0)
    # a repeat that never reached the target: the most versions, the lowest ratio
    assert vs["versions_to_target"]["shardrl"] == {"median": 20.0, "min": 20.0, "max": None,
                                                   "undefined": 1}
    assert vs["versions_to_target_ratio"] == {"median": 0.75, "min": None, "max": 0.75,
                                              "undefined": 1}
    # pooled over three equal repeats: each repeat's own crossings. Sync's target 0.5 + 0.7 x
    # 0.15 = 0.605: sync at 15 + 15 x 0.055 / 0.1 = 23.25 s, ShardRL at 10 + 10 x 0.005 / 0.2
    # = 10.25 s. TRL's 0.5 + 0.7 x 0.25 = 0.675: TRL at 30 x 0.175 / 0.2 = 26.25 s, ShardRL at
    # 10 + 10 x 0.075 / 0.2 = 13.75 s
    p = out["pooled"]
    assert p["vs_sync"]["repeats"] == 3
    assert p["vs_sync"]["sync"] == pytest.approx(23.25)
    assert p["vs_sync"]["shardrl"] == pytest.approx(10.25)
    assert p["sync_time_speedup"] == pytest.approx(23.25 / 10.25)
    assert p["vs_trl"]["trl"] == pytest.approx(26.25)
    assert p["target_time_ratio"] == pytest.approx(13.75 / 26.25)


def test_table_rows_take_the_sync_speedup_apart():
    out = summarize([_row(0.4, 2.0, 0.9), _row(None, None, 0.8), _row(0.6, 1.5, 0.85)])
    rows = {name: cell for _, name, _, cell in _trl(out | {"repeats": 3})}
    rate = next(name for name in rows if name.startswith("the speedup taken apart (1)"))
    assert "from version 1 to 30" in rate and "(medians: 8.5 / 6.0)" in rate
    assert rows[rate] == "1.42x (1.33x to 1.50x)"
    steps = next(name for name in rows if name.startswith("the speedup taken apart (2)"))
    assert "(medians: 15.0 / 20.0;" in steps
    assert rows[steps].startswith("0.75x (ShardRL never reached to 0.75x)")


def test_table_cell_of_a_spread():
    assert _spread({"median": 0.62, "min": 0.5, "max": None, "undefined": 1},
                   none="never reached") == "0.62 (0.50 to never reached), 1 never reached"
    assert _spread({"median": 1.5, "min": 1.5, "max": 1.5, "undefined": 0}) == "1.50"
    assert _spread({"median": None, "min": None, "max": None, "undefined": 3},
                   none="not recorded") == "not recorded"


def test_steady_busy_fraction_uses_the_window_only():
    from bench.curves import steady_busy_fraction

    # busy 1 s of the first 10 s (start-up), then 7.5 s of the next 10 s
    points = [(100.0, 0.5), (110.0, 1.0), (114.0, 4.0), (120.0, 8.5), (130.0, 9.0)]
    assert steady_busy_fraction(points, 110.0, 120.0) == (8.5 - 1.0) / 10.0
    assert steady_busy_fraction(points, 111.0, 119.0) is None  # one point inside
    assert steady_busy_fraction([], 0.0, 1.0) is None


def test_intervals_union_and_intersection():
    assert union([(5.0, 6.0), (1.0, 3.0), (2.0, 4.0), (7.0, 7.0)]) == [(1.0, 4.0), (5.0, 6.0)]
    assert intersect([(1.0, 4.0), (5.0, 6.0)], [(3.0, 5.5)]) == [(3.0, 4.0), (5.0, 5.5)]
    assert intersect([(1.0, 2.0)], [(2.0, 3.0)]) == []


def test_idle_together_counts_only_waits_while_every_worker_is_paused():
    # window 100..110; the learner waits 101-103 and 106-108; worker 0 paused 102-107,
    # worker 1 paused 100-102.5 and 106.5-110: all three at once 102-102.5 and 106.5-107
    waits = [(101.0, 103.0), (106.0, 108.0)]
    paused = [[(102.0, 107.0)], [(100.0, 102.5), (106.5, 110.0)]]
    assert idle_together(waits, paused, (100.0, 110.0)) == pytest.approx(0.1)
    # one worker that never paused: no bubble; an empty window or no workers: undefined
    assert idle_together(waits, [*paused, []], (100.0, 110.0)) == 0.0
    assert idle_together(waits, paused, (110.0, 110.0)) is None
    assert idle_together(waits, [], (100.0, 110.0)) is None


def test_learner_waits_end_before_the_steps_read_update_and_commit():
    # a step logged at 110 after waiting 2 s, reading 0.5, updating 1, committing 0.5: its
    # wait was 106-108; a step missing a timing is left out
    step = {"wait_s": 2.0, "read_s": 0.5, "update_s": 1.0, "commit_s": 0.5}
    points = [("learn/w00", f"learn/{k}", 3, v, 110.0) for k, v in step.items()]
    points += [("learn/w00", "learn/wait_s", 4, 1.0, 111.0)]
    assert learner_waits(points) == [(106.0, 108.0)]
    pauses = [("rollout/w00", "rollout/pause_s", 1, 2.0, 105.0),
              ("rollout/w01", "rollout/pause_s", 1, 1.0, 104.0),
              ("rollout/w00", "rollout/pause_s", 2, 0.5, 109.0)]
    assert sorted(rollout_pauses(pauses)) == [[(103.0, 104.0)], [(103.0, 105.0), (108.5, 109.0)]]


def test_value_at_reads_between_evaluations_and_holds_the_ends():
    curve = [(0.0, 0.5), (10.0, 0.6), (20.0, 0.8)]
    assert value_at(curve, 5.0) == pytest.approx(0.55)
    assert value_at(curve, 15.0) == pytest.approx(0.7)
    assert value_at(curve, -1.0) == 0.5 and value_at(curve, 25.0) == 0.8


def test_values_at_reads_a_curve_in_one_pass_as_value_at_does():
    """Every time of an ascending list, against `value_at` point by point: before, between
    and after the points, on them, and across a repeated time (a vertical step)."""
    rng = random.Random(3)
    for _ in range(50):
        ts = sorted(rng.uniform(0.0, 10.0) for _ in range(rng.randint(1, 12)))
        if len(ts) > 2:
            ts[2] = ts[1]  # two evaluations at one time
        curve = [(t, rng.random()) for t in ts]
        times = sorted([rng.uniform(-1.0, 11.0) for _ in range(30)] + ts)
        assert values_at(curve, times) == [value_at(curve, t) for t in times]
    step = [(0.0, 0.0), (5.0, 0.2), (5.0, 0.9), (10.0, 1.0)]
    assert values_at(step, [4.0, 5.0, 7.5, 12.0]) == [0.16, 0.2, 0.95, 1.0]


def test_mean_curve_is_exact_at_the_union_of_the_points():
    a = [(0.0, 0.0), (10.0, 1.0)]
    b = [(0.0, 0.0), (5.0, 1.0), (10.0, 1.0)]
    # at 5: a is half way (0.5), b is at 1: mean 0.75
    assert mean_curve([a, b]) == [(0.0, 0.0), (5.0, 0.75), (10.0, 1.0)]


def test_pooled_time_to_gain_averages_the_gain_curves_before_crossing():
    seed1 = [(0.0, 0.5), (10.0, 0.9)]  # gain over (0.5, 0.9): 0 -> 1 in 10 s
    seed2 = [(0.0, 0.6), (4.0, 1.0), (8.0, 1.0)]  # gain over (0.6, 1.0): 0 -> 1 in 4 s
    assert gain_curve(seed2, 0.6, 1.0) == [(0.0, 0.0), (4.0, pytest.approx(1.0)), (8.0, pytest.approx(1.0))]
    # mean gain at 4 s: (0.4 + 1) / 2 = 0.7; half of the gain is reached on the line from
    # (0, 0) to (4, 0.7): 0.5 / 0.7 * 4 = 20/7 s (each seed alone: 5 s and 2 s)
    t = pooled_time_to_gain([seed1, seed2], [(0.5, 0.9), (0.6, 1.0)], fraction=0.5)
    assert t == pytest.approx(20 / 7)
    assert pooled_time_to_gain([seed1, seed2], [(0.5, 0.9), (0.6, 1.0)], fraction=0.7) == \
        pytest.approx(4.0)
    # the mean never gets there
    assert pooled_time_to_gain([seed1], [(0.5, 1.0)], fraction=0.9) is None
    with pytest.raises(ValueError, match="no gain"):
        gain_curve(seed1, 0.9, 0.9)


# -- the baseline's thread count, repeats without TRL, bootstrap intervals ------------------
FAST_SYNC = [(t / 3, p) for t, p in SYNC]
"""SYNC three times as fast: its pooled time to its own target is 23.25 / 3 = 7.75 s."""


def _sync_runs_row(**runs: list) -> dict:
    row = _row(0.4, 2.0, 0.9)
    side = row.pop("sync")
    row["sync_runs"] = {t: side | {"curve": curve} for t, curve in runs.items()}
    vs = row.pop("vs_sync")
    row["vs_sync_runs"] = {t: vs | {"made_against": t} for t in runs}
    return row


def test_bootstrap_interval_of_a_mean_over_two_repeats():
    values = [1.0, 3.0]

    def mean(idx: list[int]) -> float:
        return sum(values[i] for i in idx) / len(idx)

    # resamples: (1, 1) a quarter of the time, (1, 3) or (3, 1) half, (3, 3) a quarter: the 5%
    # and 95% quantiles are the two extremes
    assert bootstrap_interval(mean, 2, draws=400) == (1.0, 3.0)
    assert bootstrap_interval(lambda idx: 7.0, 5, draws=50) == (7.0, 7.0)
    assert bootstrap_interval(mean, 1) is None  # one repeat: nothing to resample


def test_choose_baseline_takes_the_thread_count_that_reaches_its_target_soonest():
    rows = [_sync_runs_row(**{"1": SYNC, "2": FAST_SYNC}) for _ in range(2)]
    choice = choose_baseline(rows)
    # target 0.5 + 0.7 x 0.15 = 0.605 either way; ShardRL reaches it at 10.25 s (see above)
    assert choice["threads"] == 2
    assert choice["by_threads"]["1"]["pooled_seconds"] == pytest.approx(23.25)
    assert choice["by_threads"]["2"]["pooled_seconds"] == pytest.approx(7.75)
    assert choice["by_threads"]["1"]["pooled_speedup"] == pytest.approx(23.25 / 10.25)
    assert choice["by_threads"]["2"]["pooled_speedup"] == pytest.approx(7.75 / 10.25)
    for row in rows:
        assert row["sync"]["curve"] == FAST_SYNC
        assert row["vs_sync"]["made_against"] == "2"
        assert row["sync_other_threads"]["1"]["curve"] == SYNC  # kept once, beside it
        assert set(row["vs_sync_other_threads"]) == {"1"} and "sync_runs" not in row


def test_pooled_interval_spans_what_other_seeds_could_give():
    same = [_row(0.4, 2.0, 0.9) for _ in range(3)]
    # identical repeats: every resample gives the pooled figure itself
    low_high = pooled_interval(same, "sync", draws=100)
    assert low_high["low"] == pytest.approx(23.25 / 10.25)
    assert low_high["high"] == pytest.approx(23.25 / 10.25)
    assert low_high["level"] == 0.9
    # a slow and a fast baseline repeat: the fast one twice (a quarter of the resamples) gives
    # 7.75 / 10.25, the lowest value. The mixed half: the mean gain curve is (1/3 + 2/3) / 2
    # = 0.5 at 15 s (the fast curve ends there at 0.6, held) and (1 + 2/3) / 2 = 5/6 at 30 s,
    # so it crosses 0.7 at 15 + 15 x 0.2 / (1/3) = 24 s, later than the slow one's 23.25 s:
    # 24 / 10.25 is the top
    slow, fast = _row(0.4, 2.0, 0.9), _row(0.4, 2.0, 0.9)
    fast["sync"] = fast["sync"] | {"curve": FAST_SYNC}
    got = pooled_interval([slow, fast], "sync", draws=400)
    assert got["low"] == pytest.approx(7.75 / 10.25)
    assert got["high"] == pytest.approx(24.0 / 10.25)
    # ShardRL's time over TRL's (13.75 / 26.25 on every repeat)
    trl = pooled_interval(same, "trl", draws=100)
    assert trl["low"] == pytest.approx(13.75 / 26.25) == trl["high"]


def test_summarize_takes_the_trl_figures_from_the_repeats_that_ran_it():
    without_trl = _row(0.9, 1.0, 0.8)
    del without_trl["trl"], without_trl["target_time_ratio"], without_trl["time_ratio"]
    rows = [_row(0.4, 2.0, 0.9), _row(0.6, 1.5, 0.85), without_trl]
    out = summarize(rows)
    assert out["repeats_vs_trl"] == 2 and out["repeats_vs_sync"] == 3
    assert out["target_time_ratio"]["median"] == pytest.approx(0.5)  # 0.4 and 0.6 only
    assert out["trl"]["final_pass"]["median"] == pytest.approx(0.875)
    assert out["vs_sync"]["time_speedup"]["median"] == 1.5  # 1.0, 1.5, 2.0
    assert out["shardrl"]["final_pass"]["median"] == 0.85
    assert out["pooled"]["vs_trl"]["repeats"] == 2 and out["pooled"]["vs_sync"]["repeats"] == 3
    assert "trl" not in out["pooled"]["vs_sync"]  # not every repeat has a TRL curve
    assert set(pooled(rows, "sync")) == {"repeats", "shardrl", "sync"}


def test_summarize_without_any_trl_repeat_leaves_the_trl_figures_undefined():
    rows = []
    for speedup in (1.0, 2.0):
        row = _row(0.9, speedup, 0.8)
        del row["trl"], row["target_time_ratio"], row["time_ratio"]
        rows.append(row)
    out = summarize(rows)
    assert out["repeats_vs_trl"] == 0 and out["repeats_vs_sync"] == 2
    assert out["target_time_ratio"]["median"] is None
    assert out["vs_sync"]["time_speedup"]["median"] == pytest.approx(1.5)
    assert out["pooled"]["vs_trl"]["repeats"] == 0 and out["pooled"]["target_time_ratio"] is None


def test_table_names_the_chosen_thread_count_and_the_interval():
    rows = [_sync_runs_row(**{"1": SYNC, "2": FAST_SYNC}) for _ in range(2)]
    choice = choose_baseline(rows)
    out = summarize(rows) | {"repeats": 2, "seeds": [0, 1], "sync_threads": choice["threads"],
                             "sync_choice": choice["by_threads"], "eval_every": 2}
    table = {name: cell for _, name, _, cell in _trl(out)}
    chosen = next(name for name in table if name.startswith("the baseline's torch threads"))
    assert table[chosen] == "1 thread: 23.25 s / 2.27x; 2 threads: 7.75 s / 0.76x (chosen)"
    first = next(name for name in table if name.startswith("time to 70% of the sync"))
    assert "of 2 repeats, seeds 0-1; ShardRL evaluated every 2 versions, the baseline as " \
        "often in time)" in first
    pooled_row = next(name for name in table if "repeats' gain curves (each repeat's share of "
                      "its sync" in name)
    assert "90% bootstrap interval" in pooled_row
    assert table[pooled_row] == "0.76x (0.76x to 0.76x)"


def test_peak_memory_comes_from_what_the_trl_benchmark_recorded(tmp_path, monkeypatch):
    """The benchmark deletes each run once read: the memory rows come from its last repeat's
    recorded peaks, not from a run folder that is no longer there (or an old one that is)."""
    import json

    import bench.results
    from bench.run_all import record_memory

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"trl": {"rows": [
        {"seed": 0, "shardrl": {"peak_rss_mb": {"learn": 900.0}}},
        {"seed": 1, "shardrl": {"peak_rss_mb": {"learn": 1000.0, "rollout": 1100.0}}}]}}))
    monkeypatch.setattr(bench.results, "RESULTS", results)
    record_memory()
    memory = json.loads(results.read_text())["memory"]
    assert memory["peak_rss_mb"] == {"learn": 1000.0, "rollout": 1100.0}
    assert memory["run"] == "seed 1"


def test_demo_rows_give_rl_over_the_control_with_its_unpaired_standard_error():
    row = {"seed": 3, "sft_plateau": 0.5, "rl_final": 0.9, "rl_version": 60,
           "sft_continued": 0.5, "rl_seconds": 3.4, "heldout_prompts": 100}
    rows = list(_demo({"rows": [row]}))
    assert rows[0][3] == "0.500 -> 0.900 (0.500)"
    # sqrt(0.9 x 0.1 / 100 + 0.5 x 0.5 / 100) = sqrt(0.0034) = 0.0583: 5.8 points
    assert rows[1][2:] == (">= +10", "+40.0 ± 5.8")
    older = {k: v for k, v in row.items() if k != "heldout_prompts"}
    assert len(list(_demo({"rows": [older]}))) == 1  # no size recorded: no error given
