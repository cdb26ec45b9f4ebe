"""Each doctor rule on synthetic series: the intended finding fires, and only it.

`base()` is a calm 20-step run with every metric the rules read: reward creeping up
(0.3 + 0.005 i, within-batch std 0.4), per-token KL 0.01 + 0.0005 i, kl_sum 0.2 + 0.01 i,
clip fraction 0.05, entropy 1 - 0.005 i, grad norm ~1, value loss ~0.5, length ~20,
truncation 1%, filter rate 20%, |A| <= 3, held-out pass@1 rising 0.30 -> 0.36.
A symptom test replaces a few of these series. Default thresholds (window 5, min_steps 10).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardrl.config import RunConfig, load_config
from shardrl.doctor import Finding, Metrics, diagnose, format_finding
from shardrl.doctor.rules import level_shift, spike_indices

N = 20
STEP = np.arange(N)
CFG = RunConfig.model_validate({"algo": {"kl": {"placement": "loss",
                                                "controller": {"kind": "fixed", "beta": 0.05}}}})
"""KL to the reference in the loss with a fixed beta, as the synthetic series assume."""


def base() -> dict[str, np.ndarray]:
    return {
        "learn/kl_sum": 0.2 + 0.01 * STEP, "learn/kl_mean": 0.01 + 0.0005 * STEP,
        "learn/clip_frac": np.full(N, 0.05), "learn/entropy": 1.0 - 0.005 * STEP,
        "learn/grad_norm": 1.0 + 0.1 * np.sin(STEP), "learn/value_loss": 0.5 + 0.05 * np.cos(STEP),
        "learn/skipped_steps": np.zeros(N), "learn/beta": np.full(N, 0.05),
        "learn/policy_loss": 0.1 * np.sin(STEP),
        "prepare/advantage_std": 1.0 + 0.02 * np.sin(STEP),
        "prepare/advantage_abs_max": np.full(N, 3.0), "prepare/filter_rate": np.full(N, 0.2),
        "rollout/truncation_rate": np.full(N, 0.01),
        "rollout/response_length_mean": 20 + 0.5 * np.sin(STEP),
        "score/reward_rm_mean": 0.3 + 0.005 * STEP, "score/reward_rm_std": np.full(N, 0.4),
        "score/pass_rate": 0.3 + 0.005 * STEP,
    }


def metrics(series: dict[str, np.ndarray], evals=(0.30, 0.32, 0.34, 0.36)) -> Metrics:
    points = [(name, int(i), float(v)) for name, values in series.items()
              for i, v in enumerate(values)]
    points += [("evaluate/pass_at_1", 5 * j, v) for j, v in enumerate(evals)]
    return Metrics.from_points(points)


def codes(m: Metrics, cfg: RunConfig | None = None) -> list[str]:
    return [f.code for f in diagnose(m, cfg or CFG)]


def test_calm_synthetic_run_has_no_findings():
    assert codes(metrics(base())) == []


def test_a_kl_blowup_with_high_clip_fraction_and_falling_entropy():
    s = base()
    # clip 0.05 + 0.03 i passes 0.3 from i = 9; kl_sum 1.25**i passes kl_high 10 from i = 11
    # (11.6), above the median before it and with median 1.25**13 = 18.2 over i = 11..15;
    # entropy 1 - 0.04 i: 0.56 at i = 11 < 0.8 x 0.8 (its mean over i < 11).
    # (kl_mean stays 0.01 + 0.0005 i, below kl_mean_high 1: the kl_sum limit decides.)
    s["learn/kl_sum"] = 1.25 ** STEP
    s["learn/clip_frac"] = 0.05 + 0.03 * STEP
    s["learn/entropy"] = 1.0 - 0.04 * STEP
    m = metrics(s)
    assert codes(m) == ["A"]
    (f,) = diagnose(m, CFG)
    assert f.step == 11 and [e.metric for e in f.evidence] == [
        "learn/kl_sum", "learn/clip_frac", "learn/entropy"]
    assert f.evidence[0].steps[-1] == 15
    assert f.evidence[0].values[-1] == pytest.approx(1.25 ** 15)
    # the checklist's order: policy lr first, then the KL constraint, reward scale, length
    assert f.remedies[0].keys == ("learner.lr",)
    assert f.config_keys[:2] == ("learner.lr", "algo.kl.controller.beta")
    # thresholds come from cfg.doctor: kl_sum never passes kl_high 100 (1.25**19 = 69)
    assert codes(m, CFG.model_copy(update={"doctor": CFG.doctor.model_copy(
        update={"kl_high": 100.0})})) == []

    # a per-token KL above kl_mean_high (1 nat) fires A on its own
    s2 = {**s, "learn/kl_sum": base()["learn/kl_sum"], "learn/kl_mean": 0.1 * 1.25 ** STEP}
    assert codes(metrics(s2)) == ["A"]
    # all three signals are needed: steady entropy alone keeps A quiet
    s["learn/entropy"] = base()["learn/entropy"]
    assert codes(metrics(s)) == []


def test_a_waits_for_a_full_window_after_the_step_it_judges():
    # a one-step spike at step 12 (KL 300x its 0.01 level, clip 0.5, entropy halved): while
    # fewer than w = 5 points follow it, the median over them would be the spike itself
    s = base()
    s["learn/kl_mean"] = np.where(STEP == 12, 3.0, 0.01)
    s["learn/clip_frac"] = np.where(STEP == 12, 0.5, 0.05)
    s["learn/entropy"] = np.where(STEP == 12, 0.5, 1.0)
    for last in (12, 13, 16, 19):
        m = Metrics.from_points([p for p in metrics(s).to_points() if p[1] <= last])
        assert "A" not in codes(m), last
    # one that stays up is found once its window is complete (steps 12-16)
    s["learn/kl_mean"] = np.where(STEP >= 12, 3.0, 0.01)
    for last, found in ((15, False), (16, True)):
        m = Metrics.from_points([p for p in metrics(s).to_points() if p[1] <= last])
        assert ("A" in codes(m)) is found, last


def test_a_kl_blowup_whose_entropy_moves_one_update_later():
    # KL 300x its level from step 12 on with clip 0.5 there; entropy flat at 12 and halved at
    # 13: the policy measured at 12 moved far on a few tokens, the update at 12 collapsed it
    s = base()
    s["learn/kl_mean"] = np.where(STEP >= 12, 3.0, 0.01)
    s["learn/clip_frac"] = np.where(STEP == 12, 0.5, 0.05)
    s["learn/entropy"] = np.where(STEP == 13, 0.5, 1.0)
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "A" and f.step == 12
    assert f.evidence[2].note == "0.5 at step 13, down from a mean of 1 before step 12"
    # two updates later is not the blow-up's doing, also when the step between has no
    # entropy (not finite)
    s["learn/entropy"] = np.where(STEP == 14, 0.5, 1.0)
    assert codes(metrics(s)) == []
    s["learn/entropy"] = np.where(STEP == 13, np.nan, s["learn/entropy"])
    assert codes(metrics(s)) == ["E"]  # the non-finite value itself is a finding


def test_a_kl_blowup_into_high_entropy_garbage():
    s = base()
    # as above, but entropy rises 1 + 0.1 i: 2.1 at i = 11 > 1.2 x 1.5 (its mean over i < 11)
    s["learn/kl_sum"] = 1.25 ** STEP
    s["learn/clip_frac"] = 0.05 + 0.03 * STEP
    s["learn/entropy"] = 1.0 + 0.1 * STEP
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "A" and f.step == 11
    assert f.evidence[2].note == "2.1 at step 11, up from a mean of 1.5 before"


def test_a_kl_blowup_in_on_policy_batches_needs_no_clip_fraction():
    # one update per batch: a batch of the current policy's samples has ratio 1, clip_frac 0
    s = base()
    s["learn/kl_sum"] = 1.25 ** STEP
    s["learn/clip_frac"] = np.zeros(N)
    s["learn/entropy"] = 1.0 - 0.04 * STEP
    s["learn/staleness_max"] = np.zeros(N)
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "A" and f.step == 11
    assert "on-policy batch" in f.evidence[1].note
    # the same series from stale batches: clip_frac 0 there means no blow-up of the ratio...
    s["learn/staleness_max"] = np.ones(N)
    assert codes(metrics(s)) == []
    # ...unless the KL is over kl_extreme (10) x its limit: 1.25**i > 100 from i = 21, never
    # here; with 1.6**i, step 10 (110) is the first past 10 x kl_high 10 (and past 10 itself
    # at i = 5, but that step is not extreme and has no clip fraction)
    s["learn/kl_sum"] = 1.6 ** STEP
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "A" and f.step == 10 and "not needed" in f.evidence[1].note

def test_b_kl_near_zero_and_reward_flat():
    s = base()
    s["learn/kl_mean"] = np.full(N, 1e-4)
    s["learn/kl_sum"] = np.full(N, 2e-3)
    # reward 0.3 + 0.01 sin(i): early mean 0.3028, recent 0.2994: |change| 0.003 < 0.1 * 0.4
    s["score/reward_rm_mean"] = 0.3 + 0.01 * np.sin(STEP)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    s["learn/entropy"] = np.full(N, 1.0)
    m = metrics(s)
    assert codes(m) == ["B"]
    # too early to call: 9 steps < min_steps 10
    short = Metrics.from_points((n, int(t), float(v)) for n, t, v in m.to_points() if t < 9)
    assert codes(short) == []


def test_c_value_loss_and_grad_norm_spikes():
    s = base()
    s["learn/grad_norm"][12] = 20.0  # median of i=7..11 is ~1.0: 20 > 5x
    s["learn/value_loss"][14] = 8.0  # median of i=9..13 is ~0.5
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "C"
    assert {e.metric: e.steps for e in f.evidence} == {
        "learn/value_loss": (14,), "learn/grad_norm": (12,)}


@pytest.mark.parametrize("variant", ["eval_falls", "verifier_disagrees", "length_drifts"])
def test_d_reward_hacking(variant):
    s = base()
    # reward 0.3 + 0.03 i: early mean 0.36, recent 0.81: +0.45 > 0.5 * 0.4
    s["score/reward_rm_mean"] = 0.3 + 0.03 * STEP
    evals = (0.30, 0.32, 0.34, 0.36)
    if variant == "eval_falls":
        evals = (0.30, 0.35, 0.28, 0.20)  # latest 0.20 < best 0.35 - 0.05
    elif variant == "verifier_disagrees":
        s["score/pass_rate"] = 0.5 - 0.015 * STEP  # early mean 0.47, recent 0.245
    else:
        s["rollout/response_length_mean"] = 20 * 1.08 ** STEP  # recent/early mean 3.4 > 1.5
    m = metrics(s, evals)
    (f,) = diagnose(m, CFG)
    assert f.code == "D"
    assert f.evidence[0].metric == "score/reward_rm_mean" and len(f.evidence) == 2
    # climbing reward with nothing contradicting it is just learning
    assert codes(metrics({**base(), "score/reward_rm_mean": 0.3 + 0.03 * STEP})) == []


def test_e_a_reward_sliding_down_without_a_sudden_step():
    s = base()
    # reward 0.85 for 8 steps, then down 0.1 a step to 0.05 (no step change is 5x the ones
    # before, which are 0.1 as well): the best window is steps 0-4 (mean 0.85); steps 8-12
    # (0.75 ... 0.35, mean 0.55) are 0.30 lower, within reward_drop 1 x the within-batch
    # std 0.35; steps 9-13 (0.65 ... 0.25, mean 0.45) are 0.40 lower: the slide
    s["score/reward_rm_mean"] = np.maximum(0.05, np.minimum(0.85, 0.85 - 0.1 * (STEP - 7)))
    s["score/reward_rm_std"] = np.full(N, 0.35)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E" and [e.metric for e in f.evidence] == ["score/reward_rm_mean"]
    assert f.evidence[0].note == "mean 0.85 over steps 0-4, 0.45 over steps 9-13"
    # and a run that recovers afterwards is still caught where it slid
    s["score/reward_rm_mean"] = np.where(STEP < 16, s["score/reward_rm_mean"], 0.85)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    assert codes(metrics(s)) == ["E"]
    # a smaller slide, within one reward std: quiet
    s["score/reward_rm_mean"] = np.maximum(0.55, s["score/reward_rm_mean"])
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    assert codes(metrics(s)) == []


def test_e_sudden_reward_drop_and_length_shift():
    s = base()
    # reward drops from 0.355 to 0.05 at step 12 (step change before: 0.005) and stays there:
    # mean 0.345 -> 0.05, a fall of 0.295 > reward_drop 1 x the within-batch std 0.2;
    # length jumps from 20 to 35 at the same step (+75% > shift_min 50%)
    s["score/reward_rm_mean"] = np.where(STEP < 12, 0.3 + 0.005 * STEP, 0.05)
    s["score/reward_rm_std"] = np.full(N, 0.2)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    s["rollout/response_length_mean"] = np.where(STEP < 12, 20.0, 35.0)
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E"
    assert [e.metric for e in f.evidence] == ["score/reward_rm_mean",
                                              "rollout/response_length_mean"]
    assert "level shift at step 12" in f.evidence[0].note


def test_e_kl_jump_counts_only_when_it_lands_above_kl_high():
    s = base()
    # kl_sum steps from 0.2 to 2 at i = 10 and stays: a lasting shift, but 2 < kl_high 10 is
    # still a plausible KL (it often grows from ~0 early on): no finding
    s["learn/kl_sum"] = np.where(STEP < 10, 0.2, 2.0)
    assert codes(metrics(s)) == []
    s["learn/kl_sum"] = np.where(STEP < 10, 0.2, 20.0)  # lands above kl_high: collapse
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E" and "level shift at step 10" in f.evidence[0].note


def test_e_non_finite_values_and_skipped_steps():
    s = base()
    s["learn/grad_norm"] = np.where(STEP == 15, math.nan, s["learn/grad_norm"])
    s["learn/policy_loss"] = np.where(STEP == 15, math.inf, s["learn/policy_loss"])
    s["learn/skipped_steps"] = (STEP >= 15).astype(float)
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E"
    ev = {e.metric: e for e in f.evidence}
    assert ev["learn/grad_norm"].steps == (15,) and math.isnan(ev["learn/grad_norm"].values[0])
    assert ev["learn/policy_loss"].values == (math.inf,)
    assert "learn/skipped_steps" in ev


@pytest.mark.parametrize(("name", "values", "code"), [
    ("prepare/advantage_abs_max", np.where(STEP == 10, 150.0, 3.0), "advantage"),
    ("prepare/filter_rate", np.where(STEP >= 8, 0.6, 0.2), "filtering"),
    ("rollout/truncation_rate", np.full(N, 0.15), "truncation"),
])
def test_scalerl_alerts(name, values, code):
    s = base()
    s[name] = values
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == code


def test_filter_alert_needs_a_sustained_rate():
    s = base()
    # one step at 100% among 20%: the best 5-step mean is (1 + 4 * 0.2) / 5 = 0.36 <= 0.5
    s["prepare/filter_rate"] = np.where(STEP == 10, 1.0, 0.2)
    assert codes(metrics(s)) == []


def test_filter_rates_whose_mean_is_the_limit_do_not_exceed_it():
    """13/32, 1/2, 19/32, 7/16, 9/16: a mean of exactly 0.5, which a convolution rounded to
    0.5000000000000001 (above the limit); one step more at 0.75 is above it."""
    s = base()
    rates = np.full(len(STEP), 0.2)
    rates[10:15] = [13 / 32, 1 / 2, 19 / 32, 7 / 16, 9 / 16]
    s["prepare/filter_rate"] = rates
    assert codes(metrics(s)) == []
    rates[15] = 0.75  # steps 11-15: (1/2 + 19/32 + 7/16 + 9/16 + 3/4) / 5 = 0.56875
    assert codes(metrics(s)) == ["filtering"]


def test_spike_indices_by_hand():
    # i=3: median(1, 2, 1) = 1, 9 > 5 * 1; i=4: median(2, 1, 9) = 2, 3 < 10
    assert spike_indices(np.array([1.0, 2.0, 1.0, 9.0, 3.0]), 3, 5.0) == [3]


def test_level_shift_ignores_a_one_point_spike():
    spike = np.array([1.0, 1.1, 1.0, 1.1, 1.0, 9.0, 1.0, 1.1, 1.0, 1.1, 1.0])
    shift = np.array([1.0, 1.1, 1.0, 1.1, 1.0, 9.0, 9.1, 9.0, 9.1, 9.0, 9.1])
    # shift at i = 5: mean |step| before 0.1, jump 8 > 5 x 0.1; window means 1.04 -> 9.04,
    # a change of 8 >= half the jump, >= 0.5 and far beyond 2 standard errors (~0.035 each)
    assert level_shift(spike, 5, 5.0, 2.0, 0, lambda i: 0.5) is None
    assert level_shift(shift, 5, 5.0, 2.0, 0, lambda i: 0.5) == 5
    assert level_shift(shift, 5, 5.0, 2.0, -1, lambda i: 0.5) is None  # up, not down
    assert level_shift(shift, 5, 5.0, 2.0, 0, lambda i: 10.0) is None  # smaller than asked


def spikes_by_definition(values: np.ndarray, w: int, factor: float) -> list[int]:
    return [i for i in range(w, len(values))
            if np.median(values[i - w:i]) > 0 and values[i] > factor * np.median(values[i - w:i])]


def level_shift_by_definition(values, w, factor, noise_z, direction, min_change):
    for i in range(w, len(values) - w + 1):
        before, after = values[i - w:i], values[i:i + w]
        jump, change = values[i] - values[i - 1], np.mean(after) - np.mean(before)
        noise = math.sqrt(np.var(before, ddof=1) / w + np.var(after, ddof=1) / w)
        if (direction * jump >= 0 and abs(jump) > factor * np.mean(np.abs(np.diff(before)))
                and change * jump > 0 and abs(change) >= max(0.5 * abs(jump), min_change(i))
                and abs(change) > noise_z * noise):
            return i
    return None


@pytest.mark.parametrize("seed", range(6))
def test_window_scans_match_their_definitions_point_by_point(seed):
    # noisy series with planted one-point spikes and lasting shifts of random size and
    # direction: the all-windows-at-once scans find exactly what a loop over the points does
    rng = np.random.default_rng(seed)
    n, w = 400, int(rng.integers(2, 9))
    x = 1.0 + 0.1 * rng.standard_normal(n)
    for at in rng.integers(w, n, size=6):
        x[at] *= rng.choice([0.2, 3.0, 8.0])
    for at in rng.integers(w, n - w, size=3):
        x[at:] += rng.choice([-4.0, -0.5, 0.5, 4.0])
    assert spike_indices(x, w, 5.0) == spikes_by_definition(x, w, 5.0)
    asked = []

    def min_change(i):  # an index-dependent floor, as the reward's is
        asked.append(i)
        return 0.3 + 0.001 * i

    for direction in (-1, 0, 1):
        expected = level_shift_by_definition(x, w, 5.0, 2.0, direction, min_change)
        assert level_shift(x, w, 5.0, 2.0, direction, min_change) == expected
    assert spike_indices(x[:w], w, 5.0) == [] and level_shift(x[:2 * w - 1], w, 5.0, 2.0, 0,
                                                              min_change) is None
    assert asked  # the floor was consulted


def test_remedy_keys_follow_the_kl_controller():
    s = base()
    s["learn/kl_sum"], s["learn/clip_frac"] = 1.25 ** STEP, 0.05 + 0.03 * STEP
    s["learn/entropy"] = 1.0 - 0.04 * STEP
    adaptive = load_config("ppo-rlhf")
    (f,) = diagnose(metrics(s), adaptive)
    assert f.remedies[1].keys == ("algo.kl.controller.target",)
    # ppo-rlhf has a critic: symptom C lists the value-head and GAE causes and remedies; a
    # run without a critic gets only those that apply to it
    s = base()
    s["learn/value_loss"][14] = 8.0
    (c,) = diagnose(metrics(s), adaptive)
    assert [r.keys[0] for r in c.remedies] == ["algo.shaping.clip", "algo.critic.lr",
                                               "algo.advantages.lam", "learner.lr"]
    assert len(c.causes) == 4
    (c,) = diagnose(metrics(s), RunConfig())
    assert [r.keys[0] for r in c.remedies] == ["algo.shaping.clip", "learner.lr"]
    assert not any("value-head" in x or "GAE" in x for x in c.causes)


def test_finding_round_trips_and_formats_in_order():
    s = base()
    s["rollout/truncation_rate"] = np.full(N, 0.15)
    (f,) = diagnose(metrics(s), CFG)
    assert Finding.from_dict(f.to_dict()) == f
    text = format_finding(f)
    assert text.index("1. audit truncated") < text.index("2. penalise") < text.index("3. check")
    assert "rollout.max_new_tokens" in text


def test_a_short_run_says_which_rules_it_could_not_judge_yet():
    from shardrl.doctor import too_short
    from shardrl.doctor.cli import Diagnosis

    short = Metrics.from_points([(name, i, 0.5) for i in range(3) for name in (
        "score/reward_rm_mean", "learn/grad_norm", "prepare/filter_rate")])
    # window 5, min_steps 10: trends from max(10, 2 x 5) points, spikes from 6, rates from 5
    # B lacks kl_mean altogether: not assessed, and so not listed here as well
    assert too_short(short, CFG) == {
        "C": "3 step(s) of learn/grad_norm; it judges from 6",
        "D": "3 step(s) of score/reward_rm_mean; it judges from 10",
        "E": "3 step(s) of score/reward_rm_mean; it judges from 10",
        "filtering": "3 step(s) of prepare/filter_rate; it judges from 5"}
    assert too_short(metrics(base()), CFG) == {}
    no_kl = RunConfig()  # the default: no KL to a reference
    text = Diagnosis("r", "store", short, diagnose(short, no_kl), no_kl).text()
    assert "not judged yet: C (3 step(s) of learn/grad_norm; it judges from 6)" in text
    assert "not assessed: A (no KL to a reference in this run: algo.kl.placement is none)" in text
    # B lacks kl_mean: not assessed, and so not also "not judged yet" for its reward's length
    assert "not assessed: B" in text and "not judged yet: B" not in text
    assert "not judged yet: D (3 step(s)" in text


def test_drift_between_the_sampler_and_the_learner():
    s = base()
    # k3 of a healthy run stays near 0.01; at steps 9 and 12 the learner's policy is far off
    s["learn/mismatch_k3"] = np.where(np.isin(STEP, [9, 12]), np.where(STEP == 9, 0.4, 5.6), 0.01)
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "drift" and f.step == 9
    assert f.summary == "the learner's policy is 0.4 nats per token from the sampler's (KL, k3)"
    assert f.evidence[0].steps == (9, 12) and f.remedies[0].keys == ("learner.lr",)
    s["learn/mismatch_k3"] = np.full(N, 0.09)  # under drift_high 0.1
    assert codes(metrics(s)) == []


def test_the_clip_remedy_suits_the_loss_it_is_for():
    from shardrl.config import load_config
    from shardrl.doctor.findings import _clip_range

    ppo = _clip_range(load_config("demo")).action
    gspo = _clip_range(load_config("demo", ["algo.loss.kind=gspo"])).action
    assert "eps now 0.2/0.2, e.g. 0.1 -> 0.2" in ppo
    # the sequence ratio's range is some thousand times a token ratio's
    assert "eps now 0.0003/0.0004, e.g. 1.5x" in gspo and "0.1 -> 0.2" not in gspo


# -- found in review: a saturated reward, noisy evaluations, a negative k1 KL, remedy keys --
def test_a_small_dip_after_a_saturated_reward_is_no_collapse():
    """Every batch all correct (std 0) for 10 steps, then 1 sample in 40 wrong (mean 0.975,
    std 0.15): measured against the std before alone, any lasting dip counted. Half the std
    after the dip (0.075) is the least change that counts now: no E. A fall to 0.5 still is,
    and so is one of a 0/1 reward from 0.9 (std 0.3) to 0.55 (std 0.5)."""
    s = base()
    s["score/reward_rm_mean"] = np.r_[np.full(10, 1.0), [0.97, 0.98] * 5]
    s["score/reward_rm_std"] = np.r_[np.zeros(10), np.full(10, 0.15)]
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    assert codes(metrics(s)) == []
    s["score/reward_rm_mean"] = np.r_[np.full(10, 1.0), [0.5, 0.52] * 5]
    s["score/reward_rm_std"] = np.r_[np.zeros(10), np.full(10, 0.5)]
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E" and f.evidence[0].metric == "score/reward_rm_mean"
    assert f.evidence[0].note == "level shift at step 10: mean 1 -> 0.508"
    s["score/reward_rm_mean"] = np.r_[np.full(10, 0.9), [0.55, 0.56] * 5]
    s["score/reward_rm_std"] = np.r_[np.full(10, 0.3), np.full(10, 0.497)]
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    (f,) = diagnose(metrics(s), CFG)
    assert f.code == "E" and f.evidence[0].note == "level shift at step 10: mean 0.9 -> 0.554"


def test_a_held_out_fall_within_the_evaluations_noise_is_no_reward_hacking():
    """The reward rises; the latest evaluation is 0.06 below the best single one (past
    eval_drop 0.05), but each has a standard error of 0.05: 2 x sqrt(2) x 0.05 = 0.14 of
    noise. Without the errors logged, the rule reads as before."""
    s = base()
    s["score/reward_rm_mean"] = 0.3 + 0.02 * STEP
    s["score/reward_rm_std"] = np.full(N, 0.45)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    evals = [0.30, 0.36, 0.41, 0.44, 0.47, 0.46, 0.50, 0.48, 0.53, 0.47]
    points = [(name, int(i), float(v)) for name, values in s.items()
              for i, v in enumerate(values)]
    points += [("evaluate/pass_at_1", 2 * j, v) for j, v in enumerate(evals)]
    assert codes(Metrics.from_points(points)) == ["D"]
    errors = [("evaluate/pass_at_1_se", 2 * j, 0.05) for j in range(len(evals))]
    assert codes(Metrics.from_points(points + errors)) == []
    # a fall past the noise still counts, and says how much noise it passed
    points[-1] = ("evaluate/pass_at_1", 18, 0.30)
    (f,) = diagnose(Metrics.from_points(points + errors), CFG)
    assert f.code == "D" and f.evidence[1].note == (
        "latest 0.3 < best 0.53 - eval_drop and 2 standard errors (0.141)")


def test_a_negative_kl_estimate_far_from_zero_is_not_stuck_at_zero():
    cfg = RunConfig.model_validate({"algo": {"kl": {
        "placement": "reward", "estimator": "k1", "controller": {"kind": "fixed", "beta": 0.05}}}})
    s = base()
    s["score/reward_rm_mean"] = np.full(N, 0.3) + 0.01 * np.sin(STEP)
    s["score/pass_rate"] = s["score/reward_rm_mean"]
    s["learn/kl_mean"], s["learn/kl_sum"] = np.full(N, -0.5), np.full(N, -10.0)
    assert "B" not in codes(metrics(s), cfg)
    s["learn/kl_mean"] = np.full(N, -0.0001)  # k1 can read just below zero when stuck
    assert "B" in codes(metrics(s), cfg)


def _names_a_setting(cfg: RunConfig, key: str) -> bool:
    """Whether `key` is a setting of `cfg` (its variants as chosen; a section left None
    is looked up in the schema)."""
    from pydantic import BaseModel

    from shardrl.config.loader import _section_at

    node: object = cfg
    parts = key.split(".")
    for part in parts:
        if node is None:
            return _section_at(RunConfig, tuple(parts)) is not None
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            return False
        node = getattr(node, part)
    return True


@pytest.mark.parametrize("controller", ["fixed", "adaptive", "exp"])
@pytest.mark.parametrize("placement", ["none", "loss", "reward"])
@pytest.mark.parametrize("advantages", ["group", "gae"])
@pytest.mark.parametrize("loss", ["cispo", "ppo", "gspo", "dppo_tv"])
def test_every_remedy_names_settings_the_run_has(controller, placement, advantages, loss):
    from shardrl.doctor.findings import playbook

    algo = {"kl": {"placement": placement, "controller": {"kind": controller}},
            "advantages": {"estimator": advantages}, "loss": {"kind": loss}}
    if advantages == "gae":
        algo["critic"] = {}
    cfg = RunConfig.model_validate({"algo": algo})
    for code in ("A", "B", "C", "D", "E", "advantage", "filtering", "truncation", "drift"):
        for remedy in playbook(code, cfg)[2]:
            for key in remedy.keys:
                assert _names_a_setting(cfg, key), (code, remedy.action, key)


def test_a_rule_with_another_metric_to_read_is_not_unassessed():
    from shardrl.doctor import unassessed

    s = base()
    s["learn/mismatch_k3"] = np.full(N, 0.01)
    assert unassessed(metrics(s)) == {}
    del s["learn/kl_mean"], s["prepare/advantage_abs_max"]
    s["learn/advantage_abs_max"] = np.full(N, 3.0)
    assert unassessed(metrics(s)) == {"B": ["learn/kl_mean"]}  # A reads kl_sum instead
    del s["learn/kl_sum"], s["learn/advantage_abs_max"]
    assert unassessed(metrics(s)) == {
        "A": ["learn/kl_mean or learn/kl_sum"], "B": ["learn/kl_mean"],
        "advantage": ["prepare/advantage_abs_max or learn/advantage_abs_max"]}
