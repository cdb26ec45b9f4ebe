"""ScaleRL's sigmoid fit: known parameters are recovered from noisy points; too few refuse."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from shardrl.doctor import Metrics
from shardrl.doctor.fit import (
    NotEnoughData,
    ScalingFit,
    eval_points,
    fit_scaling,
    param_count,
    sigmoid,
)
from shardrl.store import LocalStore, RunKeys

A, B, C_MID, R0 = 0.8, 1.5, 1e5, 0.1


def test_sigmoid_by_hand():
    # C = C_mid: R0 + (A - R0) / 2 = 0.1 + 0.35; C = 0: R0; C -> inf: A
    r = sigmoid(np.array([C_MID, 0.0, 1e15]), A, B, C_MID, R0)
    assert r == pytest.approx([0.45, 0.1, 0.8], abs=1e-9)


@pytest.mark.parametrize("with_baseline", [True, False])
def test_fit_recovers_known_parameters_from_noisy_points(with_baseline):
    rng = np.random.default_rng(0)
    c = np.logspace(3.5, 6.5, 14)  # from 0.03 to 30 x C_mid
    if with_baseline:
        c = np.r_[0.0, c]
    r = sigmoid(c, A, B, C_MID, R0) + rng.normal(0, 0.01, len(c))
    fit = fit_scaling(c, r, n_boot=40, seed=1, skip_fraction=0.0)  # every point counts
    assert isinstance(fit, ScalingFit) and fit.r0_fixed == with_baseline
    assert fit.a == pytest.approx(A, abs=0.03)
    assert fit.b == pytest.approx(B, abs=0.3)
    assert fit.c_mid == pytest.approx(C_MID, rel=0.15)
    assert fit.r0 == pytest.approx(R0, abs=0.03)
    assert fit.n_boot > 30 and fit.a_ci[0] < fit.a < fit.a_ci[1]
    assert fit.c_mid_ci[0] < fit.c_mid < fit.c_mid_ci[1]
    assert "A (asymptote) 0.7" in fit.summary(6e6) and "FLOPs" in fit.summary(6e6)


def test_too_few_points_say_not_enough_data():
    c = np.array([0.0, 1e4, 1e5])
    fit = fit_scaling(c, sigmoid(c, A, B, C_MID, R0))
    # C = 0 fixes R0 and is not a fitted point; 1e4 is exactly 10% of the compute: it counts
    assert isinstance(fit, NotEnoughData) and fit.n_points == 2 and fit.needed == 6
    assert fit.summary() == ("not enough data for the scaling fit: 2 held-out evaluation(s) "
                             "past the first 10% of compute, at least 6 needed (evaluate more "
                             "often: eval.every)")
    # three points without a C = 0 baseline leave four free parameters: still refused
    assert isinstance(fit_scaling(np.array([1e3, 1e4, 1e5]), np.array([0.2, 0.3, 0.5]),
                                  min_points=3, skip_fraction=0.0), NotEnoughData)


def test_points_of_the_early_phase_are_left_out():
    # a run evaluated every 5% of its compute: 0, 5%, ..., 100% of 1e6 tokens
    c = np.linspace(0.0, 1e6, 21)
    r = sigmoid(c, A, B, 2e5, R0)
    fit = fit_scaling(c, r, n_boot=0)
    # C = 0 fixes R0; 5% is early; 10% .. 100% are the 19 fitted points
    assert isinstance(fit, ScalingFit) and fit.n_points == 19 and fit.r0_fixed
    assert fit.a == pytest.approx(A, abs=1e-3) and fit.c_mid == pytest.approx(2e5, rel=1e-2)
    # a wild early point changes nothing: it is not in the fit
    wild = r.copy()
    wild[1] = 0.99
    again = fit_scaling(c, wild, n_boot=0)
    assert (again.a, again.b, again.c_mid) == pytest.approx((fit.a, fit.b, fit.c_mid), rel=1e-9)
    # four evaluations (0, 35%, 70%, 100% of the run, as the old demo's) are not enough
    idx = [0, 7, 14, 20]
    few = fit_scaling(c[idx], r[idx])
    assert isinstance(few, NotEnoughData) and few.n_points == 3


def test_eval_points_accumulate_learner_tokens():
    # tokens 10, 20, 30, 40 at steps 1..4: cumulative 0 at v0, 30 at v2, 100 at v4
    pts = [("learn/tokens", s, 10.0 * s) for s in range(1, 5)]
    pts += [("evaluate/pass_at_1", v, p) for v, p in [(0, 0.1), (2, 0.2), (4, 0.3)]]
    versions, compute, rate = eval_points(Metrics.from_points(pts))
    assert versions.tolist() == [0, 2, 4] and compute.tolist() == [0.0, 30.0, 100.0]
    assert rate.tolist() == [0.1, 0.2, 0.3]


def test_param_count_from_safetensors_header(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    header = json.dumps({"__metadata__": {}, "w": {"dtype": "F32", "shape": [3, 4],
                                                   "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]}}).encode()
    store.put_bytes(keys.policy_file(0, "model.safetensors"),
                    struct.pack("<Q", len(header)) + header + bytes(64))
    assert param_count(store, keys) == 16  # 3 * 4 + 4
    assert param_count(store, RunKeys("other")) is None


def test_a_curve_that_does_not_move_has_no_fit_rather_than_its_starting_guesses():
    """With no gain, B and C_mid shape nothing: the fit stayed at its first start (B 0.50,
    C_mid the compute's first quartile) and reported it with an interval of zero width."""
    c = [0.0, 1e4, 2e4, 3e4, 4e4, 5e4, 6e4]
    flat = fit_scaling(c, [0.5] * 7, n_boot=40)
    assert isinstance(flat, NotEnoughData)
    assert flat.summary().startswith("no scaling fit: no measurable gain over R0 0.500")
    assert "B and C_mid are undetermined" in flat.summary()
    # a real gain over the same compute still fits, and says where C_mid lies
    rising = sigmoid(np.array(c), 0.8, 1.5, 2e4, 0.3)
    fit = fit_scaling(c, rising, n_boot=40)
    assert isinstance(fit, ScalingFit) and fit.c_mid == pytest.approx(2e4, rel=0.01)
    assert "extrapolation" not in fit.summary()
    beyond = fit_scaling(c, sigmoid(np.array(c), 0.8, 1.5, 2e5, 0.3), n_boot=40)
    assert isinstance(beyond, ScalingFit)
    assert "C_mid outside the compute fitted (1e+04 to 6e+04 tokens)" in beyond.summary()


def test_without_learner_tokens_the_report_says_so_not_evaluate_more_often(tmp_path):
    from shardrl.config import load_config
    from shardrl.doctor.report import scaling_fit
    from shardrl.doctor.series import RunHandle

    handle = RunHandle(LocalStore(tmp_path), RunKeys("r1"), load_config("demo"))
    evals = [("evaluate/pass_at_1", v, 0.1 * v / 10) for v in range(0, 70, 10)]
    fit = scaling_fit(handle, Metrics.from_points(evals)).fit
    assert isinstance(fit, NotEnoughData)
    assert fit.summary() == ("no scaling fit: no `learn/tokens` series: the compute behind "
                             "each evaluation is unknown")
