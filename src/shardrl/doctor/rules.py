"""The doctor's rules: one small pure function per symptom, `rule(metrics, cfg) -> Finding | None`.

Thresholds come from `cfg.doctor` (w = `window` points per comparison window). A trend
compares the mean of the first w points of a series with that of its last w, is judged only
once the series has `max(min_steps, 2w)` finite points, and counts only beyond `noise_z`
standard errors of that difference (small batches make noisy series). Rules other than the
collapse rule look at finite values only; non-finite values are the collapse rule's evidence.

  A  KL blow-up       at some step: clip_frac > clip_frac_high, entropy entropy_drop below or
                      above its mean before (then or at the next step), KL above its limit
                      (kl_mean > kl_mean_high or kl_sum > kl_high) and its past, and staying
                      above the limit over the next w steps (judged once they are there)
  B  KL stuck at 0    |median kl_mean| of the last w < kl_low, reward_rm change within
                      reward_flat reward stds (plus noise)
  C  spikes           value_loss, advantage_std or grad_norm > spike_factor x the median of
                      the w points before it
  D  reward hacking   reward_rm up by > reward_rise reward stds while held-out pass@1 falls
                      eval_drop below its best, the verifier pass rate falls by agreement_drop,
                      or the response length drifts beyond a factor length_drift
  E  collapse         non-finite values or skipped steps; or a level shift: one step's change
                      > spike_factor x the mean step change before it, the next w points staying
                      shifted: reward down by reward_drop reward stds, KL up by shift_min of its
                      level to a mean above kl_high, length either way by shift_min of its level;
                      or a slide: the mean of w reward points below the best of w before them
                      by reward_drop reward stds (plus noise)
  advantage           |advantage| > advantage_abs_max (ScaleRL)
  filtering           filter rate > filter_rate_high, averaged over w consecutive steps
  truncation          truncation rate > truncation_rate_high, averaged over w consecutive steps
  drift               KL from the sampling policy to the learner's (mismatch_k3) > drift_high
                      at some step: lag, a learning rate too high, or numerics that differ
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..config import RunConfig
from ..config.infra import DoctorConfig
from .findings import Evidence, Finding, evidence, make_finding
from .series import Metrics, Series

Rule = Callable[[Metrics, RunConfig], Finding | None]

REWARD, REWARD_STD, PASS = "score/reward_rm_mean", "score/reward_rm_std", "score/pass_rate"
KL_SUM, KL_MEAN = "learn/kl_sum", "learn/kl_mean"
LENGTH, EVAL = "rollout/response_length_mean", "evaluate/pass_at_1"
EVAL_SE = "evaluate/pass_at_1_se"
SPIKE_METRICS = ("learn/value_loss", "prepare/advantage_std", "learn/grad_norm")


def _finite(m: Metrics, name: str) -> Series | None:
    s = m.get(name)
    s = s.finite() if s is not None else None
    return s if s is not None and len(s) else None


def _trend_ready(s: Series | None, d: DoctorConfig) -> bool:
    return s is not None and len(s) >= max(d.min_steps, 2 * d.window)


def _noise(a: np.ndarray, b: np.ndarray) -> float:
    """Standard error of mean(b) - mean(a) from the spread within each window."""
    return float(np.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b)))


def _change(s: Series, w: int) -> tuple[float, float, float]:
    """(mean of the first w points, mean of the last w, standard error of the difference)."""
    a, b = s.values[:w], s.values[-w:]
    return float(np.mean(a)), float(np.mean(b)), _noise(a, b)


def _recent(s: Series, w: int, note: str) -> Evidence:
    return evidence(s.name, s.steps[-w:], s.values[-w:], note)


def reward_scale(m: Metrics) -> float:
    """The reward's natural unit: the mean within-batch std of reward_rm (floored at 1e-6)."""
    s = _finite(m, REWARD_STD)
    return max(float(np.mean(s.values)), 1e-6) if s is not None else 1e-6


def _aligned(*series: Series) -> tuple[np.ndarray, list[np.ndarray]]:
    """The steps every series has (K,), and each series' values at them (K,)."""
    steps = series[0].steps
    for s in series[1:]:
        steps = np.intersect1d(steps, s.steps)
    return steps, [s.values[np.searchsorted(s.steps, steps)] for s in series]


def kl_blowup(m: Metrics, cfg: RunConfig) -> Finding | None:
    """Symptom A: KL to the reference shoots up, with a high clip fraction and entropy moving
    sharply.

    Step i qualifies when, at i, clip_frac > clip_frac_high and KL (kl_mean vs kl_mean_high,
    or kl_sum vs kl_high) is above the limit and above its median before i, with its median
    over [i, i+w) staying above it; and entropy is entropy_drop below or above its mean
    before i, at i or at the step after it.
    A blow-up can take a single step, and what follows it varies (a policy gone deterministic,
    its entropy falling, or one emitting high-entropy garbage, its entropy rising), so the
    signals are read at the step itself and entropy may move either way. The mean entropy
    may show it one update later than the KL: the KL estimate (k3) is dominated by the few
    tokens the policy moved far from, the entropy is averaged over all of them.
    The learner makes one update per batch, so only stale samples can be clipped: a batch
    whose samples all come from the current policy (`staleness_max` 0) has clip_frac 0
    whatever happens, and a KL `kl_extreme` times its limit needs no clip fraction either.
    """
    d, w = cfg.doctor, cfg.doctor.window
    clip, ent = _finite(m, "learn/clip_frac"), _finite(m, "learn/entropy")
    if clip is None or ent is None:
        return None
    lag = _finite(m, "learn/staleness_max")
    for name, limit in ((KL_MEAN, d.kl_mean_high), (KL_SUM, d.kl_high)):
        kl = _finite(m, name)
        if kl is None:
            continue
        steps, (k, c, e, *g) = _aligned(kl, clip, ent, *((lag,) if lag is not None else ()))
        on_policy = g[0] == 0 if g else np.zeros(len(steps), dtype=bool)
        for i in range(1, len(steps) - w + 1):  # a full window after i: a spike at the
            after_kl = k[i:i + w]                 # newest steps is judged once it has one
            clipping = c[i] > d.clip_frac_high or on_policy[i] or k[i] > d.kl_extreme * limit
            before = np.mean(e[:i])
            then = (i, i + 1) if steps[i + 1] == steps[i] + 1 else (i,)  # the next update's
            moved = [j for j in then if abs(e[j] - before) > d.entropy_drop * before]
            if (clipping and k[i] > limit and k[i] > np.median(k[:i])
                    and np.median(after_kl) > limit and moved):
                j = moved[0]
                end = min(i + w, len(steps))
                ev = [
                    evidence(name, steps[:end], k[:end],
                             f"{k[i]:.3g} at step {steps[i]} > {limit:g}, median "
                             f"{np.median(after_kl):.3g} from there (before: "
                             f"{np.median(k[:i]):.3g})"),
                    evidence(clip.name, steps[:end], c[:end],
                             f"{c[i]:.3g} at step {steps[i]} > clip_frac_high "
                             f"{d.clip_frac_high:g}" if c[i] > d.clip_frac_high else
                             f"{c[i]:.3g} at step {steps[i]}: an on-policy batch (ratio 1), "
                             "so the clip fraction cannot show it" if on_policy[i] else
                             f"{c[i]:.3g} at step {steps[i]}, not needed: the KL is over "
                             f"{d.kl_extreme:g}x its limit"),
                    evidence(ent.name, steps[:end], e[:end],
                             f"{e[j]:.3g} at step {steps[j]}, "
                             f"{'down' if e[j] < before else 'up'} from a mean of "
                             f"{before:.3g} before" + (f" step {steps[i]}" if j > i else "")),
                ]
                return make_finding("A", "KL to the reference blows up with a high clip "
                                         "fraction and a sharp change of entropy", ev, cfg,
                                    int(steps[i]))
    return None


def kl_stuck(m: Metrics, cfg: RunConfig) -> Finding | None:
    """Symptom B: per-token KL near zero for a long time while reward_rm does not move."""
    d, w = cfg.doctor, cfg.doctor.window
    kl, rew = _finite(m, KL_MEAN), _finite(m, REWARD)
    if not (_trend_ready(kl, d) and _trend_ready(rew, d)):
        return None
    kl_recent = float(np.median(kl.values[-w:]))
    early, recent, se = _change(rew, w)
    scale = reward_scale(m)
    if abs(kl_recent) >= d.kl_low or abs(recent - early) > d.reward_flat * scale + d.noise_z * se:
        return None
    ev = [_recent(kl, w, f"median {kl_recent:.3g} over the last {w} steps, within "
                         f"kl_low {d.kl_low:g} of 0"),
          evidence(rew.name, rew.steps, rew.values,
                   f"mean {early:.3g} -> {recent:.3g}: change within {d.reward_flat:g} reward "
                   f"std ({scale:.3g}) + {d.noise_z:g} standard errors ({se:.3g})")]
    for name in ("learn/entropy", "learn/clip_frac"):
        s = _finite(m, name)
        if s is not None:
            ev.append(_recent(s, w, "for context"))
    return make_finding("B", "KL stays near zero and the reward does not move: the policy "
                             "hardly learns", ev, cfg)


def spike_indices(values: np.ndarray, w: int, factor: float) -> list[int]:
    """Indices i >= w with values[i] > factor * median(values[i-w:i]) (a positive median).

    One median per window, all windows at once: the live doctor runs this over the whole
    series every few steps, so a loop over the points would grow with the run's length."""
    if len(values) <= w:
        return []
    base = np.median(sliding_window_view(values[:-1], w), axis=1)  # (N - w,): i = w..N-1
    hit = (base > 0) & (values[w:] > factor * base)
    return (np.flatnonzero(hit) + w).tolist()


def spikes(m: Metrics, cfg: RunConfig) -> Finding | None:
    """Symptom C: value loss, advantage std or gradient norm spike above their running median."""
    d, ev = cfg.doctor, []
    for name in SPIKE_METRICS:
        s = _finite(m, name)
        if s is None:
            continue
        idx = spike_indices(s.values, d.window, d.spike_factor)
        if idx:
            ev.append(evidence(name, s.steps[idx], s.values[idx],
                               f"{len(idx)} point(s) above {d.spike_factor:g}x the median of "
                               f"the {d.window} before"))
    if not ev:
        return None
    names = ", ".join(e.metric.split("/")[1] for e in ev)
    return make_finding("C", f"spikes in {names}: training oscillates", ev, cfg)


def reward_hacking(m: Metrics, cfg: RunConfig) -> Finding | None:
    """Symptom D: reward_rm climbs while held-out pass rate or verifier agreement falls, or the
    response length drifts."""
    d, w = cfg.doctor, cfg.doctor.window
    rew = _finite(m, REWARD)
    if not _trend_ready(rew, d):
        return None
    early, recent, se = _change(rew, w)
    scale = reward_scale(m)
    if recent - early <= d.reward_rise * scale + d.noise_z * se:
        return None
    signs = []
    ev_s = _finite(m, EVAL)
    if ev_s is not None and len(ev_s) >= 2:
        j = int(np.argmax(ev_s.values[:-1]))
        best, latest = float(ev_s.values[j]), float(ev_s.values[-1])
        # the best of several noisy evaluations reads high: the fall must also pass the two
        # evaluations' noise, when they recorded their standard errors
        errors = _finite(m, EVAL_SE)
        noise = 0.0
        if errors is not None:
            at = dict(zip(errors.steps.tolist(), errors.values.tolist(), strict=True))
            se_best, se_latest = at.get(int(ev_s.steps[j])), at.get(int(ev_s.steps[-1]))
            if se_best is not None and se_latest is not None:
                noise = d.noise_z * float(np.hypot(se_best, se_latest))
        if latest < best - max(d.eval_drop, noise):
            why = f" and {d.noise_z:g} standard errors ({noise:.3g})" if noise else ""
            signs.append(evidence(EVAL, ev_s.steps, ev_s.values,
                                  f"latest {latest:.3g} < best {best:.3g} - eval_drop{why}"))
    agree = _finite(m, PASS)
    if _trend_ready(agree, d):
        a0, a1, a_se = _change(agree, w)
        if a1 < a0 - d.agreement_drop - d.noise_z * a_se:
            signs.append(_recent(agree, w, f"verifier pass rate {a0:.3g} -> {a1:.3g}"))
    length = _finite(m, LENGTH)
    if _trend_ready(length, d):
        l0, l1, _ = _change(length, w)
        if l0 > 0 and not 1 / d.length_drift <= l1 / l0 <= d.length_drift:
            signs.append(_recent(length, w, f"mean length {l0:.3g} -> {l1:.3g} "
                                            f"(beyond x{d.length_drift:g})"))
    if not signs:
        return None
    ev = [evidence(rew.name, rew.steps, rew.values,
                   f"mean {early:.3g} -> {recent:.3g}: up more than {d.reward_rise:g} reward std")]
    return make_finding("D", "the reward climbs but " + " and ".join(
        {EVAL: "held-out pass@1 falls", PASS: "the verifier disagrees",
         LENGTH: "the length drifts"}[e.metric] for e in signs), ev + signs, cfg)


def level_shift(values: np.ndarray, w: int, factor: float, noise_z: float, direction: int,
                min_change: Callable[[int], float]) -> int | None:
    """First index i where the series jumps to a new level and stays there.

    Step i qualifies when |x[i] - x[i-1]| > factor * mean(|diff(x[i-w:i])|); the mean of
    x[i:i+w] differs from that of x[i-w:i] in the jump's direction by at least half the jump,
    by at least `min_change(i)` and by more than `noise_z` standard errors; and `direction`
    (+1 up, -1 down, 0 either) agrees. A one-point spike fails the "stays there" test.
    w >= 2 (`doctor.window`). Every window's statistics are computed at once; `min_change` is
    called only at the indices that pass the rest, in order.
    """
    n = len(values)
    if n < 2 * w:
        return None
    windows = sliding_window_view(values, w)  # (N - w + 1, w): row j is x[j:j+w]
    means, var = windows.mean(axis=1), windows.var(axis=1, ddof=1)
    typical = sliding_window_view(np.abs(np.diff(values)), w - 1).mean(axis=1)  # row j: x[j:j+w]
    i = np.arange(w, n - w + 1)  # candidates; x[i-w:i] is row i - w, x[i:i+w] row i
    jump = values[i] - values[i - 1]
    change = means[i] - means[i - w]
    noise = np.sqrt(var[i - w] / w + var[i] / w)  # `_noise` of the two windows
    ok = ((direction * jump >= 0) & (np.abs(jump) > factor * typical[i - w]) & (change * jump > 0)
          & (np.abs(change) >= 0.5 * np.abs(jump)) & (np.abs(change) > noise_z * noise))
    for k in np.flatnonzero(ok):
        if abs(change[k]) >= min_change(int(i[k])):
            return int(i[k])
    return None


def decline(values: np.ndarray, w: int, min_drop: float, noise_z: float
            ) -> tuple[int, int, float, float] | None:
    """The first slide: (j, t, mean of x[j:j+w], mean of x[t:t+w]) for the first t at which
    the mean of x[t:t+w] lies below the best mean of w consecutive points ending before t,
    x[j:j+w], by more than `min_drop` and `noise_z` standard errors of the difference; None
    if there is none. A run that recovers later is still caught where it slid. w >= 2."""
    n = len(values)
    if n < 2 * w:
        return None
    means = sliding_window_view(values, w).mean(axis=1)  # row j: x[j:j+w]
    best_until = np.maximum.accumulate(means)  # best_until[i]: the best of rows 0..i
    for t in np.flatnonzero(best_until[:n - 2 * w + 1] - means[w:] > min_drop) + w:
        j = int(np.argmax(means[:t - w + 1]))
        if means[j] - means[t] > noise_z * _noise(values[j:j + w], values[t:t + w]):
            return j, int(t), float(means[j]), float(means[t])
    return None


def _min_change(m: Metrics, s: Series, d: DoctorConfig, unit: str) -> Callable[[int], float]:
    """The smallest level change of `s` that counts at index i: shift_min of its level over
    the w points before ('level'), or reward_drop times the reward std ('reward'): its mean
    over the w points before, but no less than half its mean over the w from i. A solved
    task's batches have std 0 before a dip; measured against that alone, any lasting dip of
    a few samples counted as a collapse. (The larger of the two in full let a fall from 0.9
    to 0.55 of a 0/1 reward pass: its std rises toward 0.5 as the mean does.)"""
    w = d.window
    if unit == "level":
        return lambda i: d.shift_min * abs(float(np.mean(s.values[i - w:i])))
    std = _finite(m, REWARD_STD)

    def spread(steps: np.ndarray) -> float | None:
        near = std.values[np.isin(std.steps, steps)] if std is not None else []
        return float(np.mean(near)) if len(near) else None

    def reward(i: int) -> float:
        before, after = spread(s.steps[i - w:i]), spread(s.steps[i:i + w])
        if before is None and after is None:
            return d.reward_drop * reward_scale(m)
        return d.reward_drop * max(before or 0.0, 0.5 * (after or 0.0))

    return reward


def collapse(m: Metrics, cfg: RunConfig) -> Finding | None:
    """Symptom E: non-finite values, skipped steps, or a sudden lasting shift in reward (down),
    KL (up) or response length (either way)."""
    d, w = cfg.doctor, cfg.doctor.window
    ev = []
    for name in m.names():
        s = m.get(name)
        bad = ~np.isfinite(s.values)
        if bad.any():
            ev.append(evidence(name, s.steps[bad], s.values[bad], f"{int(bad.sum())} non-finite"))
    skipped = _finite(m, "learn/skipped_steps")
    if skipped is not None and skipped.values[-1] > 0:
        ev.append(evidence(skipped.name, skipped.steps, skipped.values,
                           "steps skipped for a non-finite loss or gradient"))
    # (metric, direction, unit of the smallest change, level the new mean must pass): KL
    # growing from ~0 early on is normal, so a KL shift counts only when it lands above kl_high
    checks = ((REWARD, -1, "reward", -np.inf), (KL_SUM, 1, "level", d.kl_high),
              (LENGTH, 0, "level", -np.inf))
    for name, direction, unit, above in checks:
        s = _finite(m, name)
        if s is None:
            continue
        min_change = _min_change(m, s, d, unit)
        i = level_shift(s.values, w, d.spike_factor, d.noise_z, direction, min_change)
        if i is not None and np.mean(s.values[i:i + w]) > above:
            before, after = np.mean(s.values[i - w:i]), np.mean(s.values[i:i + w])
            ev.append(evidence(name, s.steps[i - w:i + w], s.values[i - w:i + w],
                               f"level shift at step {int(s.steps[i])}: mean {before:.3g} -> "
                               f"{after:.3g}"))
    rew = _finite(m, REWARD)
    if rew is not None and (fall := decline(rew.values, w, d.reward_drop * reward_scale(m),
                                            d.noise_z)) is not None \
            and REWARD not in (e.metric for e in ev):
        j, t, best, low = fall
        ev.append(evidence(REWARD, rew.steps[j:t + w], rew.values[j:t + w],
                           f"mean {best:.3g} over steps {int(rew.steps[j])}-"
                           f"{int(rew.steps[j + w - 1])}, {low:.3g} over steps "
                           f"{int(rew.steps[t])}-{int(rew.steps[t + w - 1])}"))
    if not ev:
        return None
    return make_finding("E", "metrics broke down mid-run: " + ", ".join(
        dict.fromkeys(e.metric for e in ev)), ev, cfg)


def _over(m: Metrics, cfg: RunConfig, name: str, limit: float, code: str,
          what: str) -> Finding | None:
    """A rate whose mean over some w consecutive steps exceeds `limit`."""
    w = cfg.doctor.window
    s = _finite(m, name)
    if s is None or len(s) < w:
        return None
    # each window's own mean: a convolution's rounding put a window of rates exactly at the
    # limit (filter rates are multiples of 1/32 or 1/48) just above it
    rolling = np.lib.stride_tricks.sliding_window_view(s.values, w).mean(axis=1)  # (N - w + 1,)
    hits = np.flatnonzero(rolling > limit)
    if not len(hits):
        return None
    end = int(hits[0]) + w
    return make_finding(code, f"{what} {rolling[hits[0]]:.1%} over {w} steps", [evidence(
        name, s.steps[:end], s.values[:end],
        f"mean {rolling[hits[0]]:.3g} over steps {int(s.steps[end - w])}-{int(s.steps[end - 1])}"
        f" > {limit:g}")], cfg)


def advantage_explosion(m: Metrics, cfg: RunConfig) -> Finding | None:
    """ScaleRL alert: |advantage| above advantage_abs_max."""
    limit, ev = cfg.doctor.advantage_abs_max, []
    for name in ("prepare/advantage_abs_max", "learn/advantage_abs_max"):
        s = _finite(m, name)
        if s is not None and (s.values > limit).any():
            big = s.values > limit
            ev.append(evidence(name, s.steps[big], s.values[big], f"|A| > {limit:g}"))
    if not ev:
        return None
    return make_finding("advantage", f"|advantage| above {limit:g}", ev, cfg)


def over_filtering(m: Metrics, cfg: RunConfig) -> Finding | None:
    """ScaleRL alert: the zero-variance filter drops most samples."""
    return _over(m, cfg, "prepare/filter_rate", cfg.doctor.filter_rate_high, "filtering",
                 "the filters drop")


def truncation(m: Metrics, cfg: RunConfig) -> Finding | None:
    """ScaleRL alert: many responses hit the token limit."""
    return _over(m, cfg, "rollout/truncation_rate", cfg.doctor.truncation_rate_high,
                 "truncation", "responses truncated at the limit:")


def policy_drift(m: Metrics, cfg: RunConfig) -> Finding | None:
    """The policy the learner trains has moved far from the one that sampled its batch:
    `learn/mismatch_k3` (k3 of KL(sampler || learner) on the batch's tokens, lag included)
    above drift_high. The clipped or truncated update then learns little from those samples,
    and a collapse often follows."""
    limit = cfg.doctor.drift_high
    s = _finite(m, "learn/mismatch_k3")
    if s is None or not (far := s.values > limit).any():
        return None
    first = int(np.flatnonzero(far)[0])
    return make_finding("drift", f"the learner's policy is {s.values[first]:.3g} nats per token "
                                 f"from the sampler's (KL, k3)", [evidence(
        s.name, s.steps[far], s.values[far], f"> drift_high {limit:g}")], cfg,
                        int(s.steps[first]))


RULES: tuple[tuple[str, Rule, tuple[str | tuple[str, ...], ...]], ...] = (
    ("A", kl_blowup, ((KL_MEAN, KL_SUM), "learn/clip_frac", "learn/entropy")),
    ("B", kl_stuck, (KL_MEAN, REWARD)),
    ("C", spikes, ("learn/grad_norm",)),
    ("D", reward_hacking, (REWARD,)),
    ("E", collapse, ()),
    ("advantage", advantage_explosion,
     (("prepare/advantage_abs_max", "learn/advantage_abs_max"),)),
    ("filtering", over_filtering, ("prepare/filter_rate",)),
    ("truncation", truncation, ("rollout/truncation_rate",)),
    ("drift", policy_drift, ("learn/mismatch_k3",)),
)
"""(code, rule, metrics it needs) in the checklist's order; a tuple among them: any one of
its metrics will do."""


def diagnose(m: Metrics, cfg: RunConfig) -> list[Finding]:
    """Every finding of the run's metrics, in the checklist's order."""
    return [f for _, rule, _ in RULES if (f := rule(m, cfg)) is not None]


def too_short(m: Metrics, cfg: RunConfig) -> dict[str, str]:
    """Rules whose metrics exist but hold fewer points than the rule judges: code -> why. A
    short run's "no findings" is then not read as a clean bill of health. A rule that lacks
    a metric altogether is `unassessed`, not also here."""
    d = cfg.doctor
    missing = unassessed(m)
    w, trend = d.window, max(d.min_steps, 2 * d.window)
    need = {"A": (KL_MEAN, w + 1), "B": (REWARD, trend), "C": ("learn/grad_norm", w + 1),
            "D": (REWARD, trend), "E": (REWARD, 2 * w), "filtering": ("prepare/filter_rate", w),
            "truncation": ("rollout/truncation_rate", w)}
    out = {}
    for code, (name, points) in need.items():
        s = _finite(m, name)
        if s is not None and len(s) < points and code not in missing:
            out[code] = f"{len(s)} step(s) of {name}; it judges from {points}"
    return out


def unassessed(m: Metrics) -> dict[str, list[str]]:
    """Rules that could not look at this run: code -> the metrics it lacks."""
    def lacking(need: str | tuple[str, ...]) -> str | None:
        names = (need,) if isinstance(need, str) else need
        return None if any(n in m for n in names) else " or ".join(names)

    return {code: missing for code, _, needs in RULES
            if (missing := [n for need in needs if (n := lacking(need)) is not None])}
