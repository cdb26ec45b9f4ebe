"""bench/trl_bench.py: the curve arithmetic behind the TRL comparison, the reward adapter and
the budget callback, on hand-computed cases (no TRL needed)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from bench.trl_bench import (
    EARLY_VERSIONS,
    compare,
    early_figures,
    early_mean,
    make_budget_callback,
    pass_at,
    spread,
    time_to_reach,
    trl_loss_args,
    verifier_reward,
)
from transformers import TrainerCallback

from shardrl.tasks.cipher import CipherTask

SHARDRL = [(0.0, 0.5), (10.0, 0.6), (20.0, 0.8), (40.0, 0.9)]
TRL = [(0.0, 0.5), (30.0, 0.7), (60.0, 0.75)]


def test_time_to_reach_is_the_first_measured_point_at_or_above_the_target():
    assert time_to_reach(SHARDRL, 0.6) == 10.0  # equal counts as reached
    assert time_to_reach(SHARDRL, 0.75) == 20.0  # 0.6 at 10s is short, 0.8 at 20s is not
    assert time_to_reach(SHARDRL, 0.5) == 0.0
    assert time_to_reach(SHARDRL, 0.95) is None


def test_pass_at_is_the_newest_point_not_after_the_time():
    assert pass_at(SHARDRL, 25.0) == 0.8  # the 20s point; the 40s one is not there yet
    assert pass_at(SHARDRL, 40.0) == 0.9
    assert pass_at(SHARDRL, 1e6) == 0.9
    with pytest.raises(ValueError):
        pass_at([(5.0, 0.5)], 1.0)


def test_compare_against_hand_computed_figures():
    got = compare(SHARDRL, TRL)
    # TRL ends at 60s with 0.75; ShardRL first measures >= 0.75 at 20s: 20 / 60 = 1/3;
    # at 60s ShardRL has its 40s point, 0.9: gap 0.9 - 0.75 = 0.15
    assert got["trl_final_pass"] == 0.75 and got["trl_final_seconds"] == 60.0
    assert got["shardrl_seconds_to_trl_final"] == 20.0
    assert got["time_ratio"] == pytest.approx(1 / 3)
    assert got["pass_gap"] == pytest.approx(0.15)
    assert got["trl_best_pass"] == 0.75 and got["shardrl_best_pass"] == 0.9
    # the other way round: TRL never reaches ShardRL's final 0.9
    back = compare(TRL, SHARDRL)
    assert back["time_ratio"] is None
    assert back["pass_gap"] == pytest.approx(0.7 - 0.9)  # TRL's 30s point at 40s


def test_early_figures_over_the_versions_where_targets_are_crossed():
    lo, hi = EARLY_VERSIONS
    published = {v: 100.0 + 0.1 * v for v in range(1, hi + 5)}  # one version per 0.1 s
    points = []
    for v in range(1, hi + 5):
        t = published[v]
        # the learner: 0.06 s of update CPU and 0.08 s busy per step, 120 kept rows (150
        # on the first step, which the window leaves out)
        points += [("learn/w00", "learn/busy_cpu_s", v, 0.06 * v, t),
                   ("learn/w00", "learn/busy_s", v, 0.08 * v, t),
                   ("learn/w00", "learn/samples", v, 150.0 if v == 1 else 120.0, t)]
        # two workers, busy 0.5 and 0.3 of the time (generating 0.4 and 0.2)
        for w, busy, gen in (("rollout/w00", 0.5, 0.4), ("rollout/w01", 0.3, 0.2)):
            points += [(w, "rollout/busy_s", v, busy * (t - 100.0), t),
                       (w, "rollout/generating_s", v, gen * (t - 100.0), t)]
    got = early_figures(points, published)
    assert got["update_cpu_ms"] == pytest.approx(60.0)
    assert got["rows"] == pytest.approx(120.0)
    busy = got["busy_fraction"]
    assert busy["rollout"] == pytest.approx(0.4)  # the workers' mean
    assert busy["rollout_generating"] == pytest.approx(0.3)
    assert busy["learner"] == pytest.approx(0.8)  # 0.08 s per 0.1 s
    assert busy["learner_cpu"] == pytest.approx(0.6)
    # a run that never reached the window's last version has no figures
    assert early_figures(points, {v: t for v, t in published.items() if v < hi}) == {}


def test_early_mean_takes_the_steps_after_the_first_version_up_to_the_last():
    lo, hi = EARLY_VERSIONS
    per_step = [1.0] * lo + [2.0] * (hi - lo) + [9.0]  # entry i made version i + 1
    assert early_mean(per_step, 1000.0) == pytest.approx(2000.0)
    assert early_mean(per_step[: hi - 1]) is None  # version `hi` was never made
    assert early_mean(None) is None


def test_spread_skips_undefined_values():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                             "undefined": 1}
    assert spread([None]) == {"median": None, "min": None, "max": None, "undefined": 1}


def test_verifier_reward_scores_with_the_task_checker():
    reward = verifier_reward(CipherTask().verify)
    # "cafj=" -> "dbga"; surrounding whitespace is ignored, one wrong letter is wrong
    assert reward([" dbga\n", "dbgb"], ["dbga", "dbga"], prompts=["cafj="] * 2) == [1.0, 0.0]


def test_cispo_and_ppo_clip_map_to_trl():
    assert trl_loss_args(SimpleNamespace(kind="cispo", max_ratio=4.0)) == {
        "loss_type": "cispo", "epsilon_high": 4.0}
    assert trl_loss_args(SimpleNamespace(kind="ppo", eps_low=0.2, eps_high=0.28,
                                         dual_clip=None)) == {
        "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}
    with pytest.raises(ValueError, match="ppo without dual_clip"):
        trl_loss_args(SimpleNamespace(kind="ppo", eps_low=0.2, eps_high=0.2, dual_clip=3.0))
    with pytest.raises(ValueError, match="'gspo'"):
        trl_loss_args(SimpleNamespace(kind="gspo"))


class _Model:
    def __init__(self) -> None:
        self.train_calls = 0

    def train(self) -> None:
        self.train_calls += 1


def test_budget_callback_evaluates_on_schedule_and_stops_at_the_budget():
    values = iter([0.25, 0.5])
    # the clock started 5 s ago; evaluate every 2 s, stop at 8 s
    cb = make_budget_callback(time.time() - 5.0, 8.0, 2.0, lambda m: next(values))
    assert isinstance(cb, TrainerCallback)
    model, control = _Model(), SimpleNamespace(should_training_stop=False)
    cb.on_step_end(None, None, control, model=model)
    # 5 s >= the first mark (2 s): one evaluation; the next mark is the first past 5 s: 6 s
    assert [p for _, p in cb.curve] == [0.25] and cb.next_eval == 6.0
    assert not control.should_training_stop and model.train_calls == 1
    cb.on_step_end(None, None, control, model=model)  # still ~5 s: no evaluation
    assert len(cb.curve) == 1
    cb.paused -= 4.0  # as if 4 more seconds of training passed: 9 s >= 8 s
    cb.on_step_end(None, None, control, model=model)
    assert [p for _, p in cb.curve] == [0.25, 0.5] and control.should_training_stop
    assert cb.curve[1][0] == pytest.approx(9.0, abs=0.5)
