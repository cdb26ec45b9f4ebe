"""Pure arithmetic of the peer comparisons (bench/trl_bench.py, bench/sync_baseline.py).

A curve is held-out pass@1 against seconds of RL wall clock, sampled at evaluations, in
time order, starting at the shared SFT snapshot (t=0). Nothing here reads files or clocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

Curve = list[tuple[float, float]]
"""(seconds of RL wall clock, held-out pass@1), in time order."""

TARGET_FRACTION = 0.7
"""Share of a reference system's gain over the snapshot that the time-to-target figures use."""


def time_to_reach(curve: Curve, target: float) -> float | None:
    """Seconds of the first point whose pass@1 is at least `target`; None if none is.

    The curve is sampled at evaluations, so this is the first *measured* time (no
    interpolation between points): up to one interval after the rate was first reached, or
    before it when one noisy evaluation reads high. Not a bound either way.
    """
    return next((t for t, p in curve if p >= target - 1e-9), None)


def time_to_reach_interpolated(curve: Curve, target: float) -> float | None:
    """When the curve first crosses `target`, read off the straight line between the last
    point below it and the first point at or above it; None if no point reaches it.

    An estimate, not a bound: evaluations a few seconds apart put each system's first
    *measured* time up to one interval late, and two systems evaluated at different moments
    are late by different amounts; between points the curve is taken as linear.
    """
    for (t0, p0), (t1, p1) in pairwise(curve):
        if p0 >= target - 1e-9:
            return t0
        if p1 >= target - 1e-9:
            return t0 + (t1 - t0) * (target - p0) / (p1 - p0)
    return curve[0][0] if curve and curve[0][1] >= target - 1e-9 else None


def pass_at(curve: Curve, seconds: float) -> float:
    """pass@1 of the newest point at or before `seconds`: what a user has at that time."""
    before = [p for t, p in curve if t <= seconds]
    if not before:
        raise ValueError(f"the curve has no point at or before {seconds:.1f}s")
    return before[-1]


def target_pass(v0: float, best: float, fraction: float = TARGET_FRACTION) -> float | None:
    """`v0 + fraction * (best - v0)`: a pass@1 that closes `fraction` of a system's gain
    over the snapshot. None when the system gained nothing (`best <= v0`): no target."""
    if best <= v0:
        return None
    return v0 + fraction * (best - v0)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is undefined or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def time_to_target(reference: Curve, *others: Curve,
                   fraction: float = TARGET_FRACTION) -> dict:
    """The target from `reference` (v0 = its t=0 point, `fraction` of its best gain) and
    each curve's first measured time at or above it: `reference` first, then `others`.

    {"v0", "best", "target", "seconds": [reference's time, *others' times], "crossing":
    the same with `time_to_reach_interpolated`}; a time is None when that curve never
    reaches the target, and every time is None without a target.
    """
    v0, best = reference[0][1], max(p for _, p in reference)
    target = target_pass(v0, best, fraction)
    curves = (reference, *others)
    seconds = [None if target is None else time_to_reach(c, target) for c in curves]
    crossing = [None if target is None else time_to_reach_interpolated(c, target)
                for c in curves]
    return {"v0": v0, "best": best, "target": target, "seconds": seconds,
            "crossing": crossing}


def value_at(curve: Curve, seconds: float) -> float:
    """pass@1 at `seconds` read off the straight lines between evaluations; the first point's
    value before it, the last point's after it (`values_at` for one time)."""
    return values_at(curve, [seconds])[0]


def gain_curve(curve: Curve, v0: float, best: float) -> Curve:
    """`curve` as the share of a reference's gain, (pass@1 - v0) / (best - v0)."""
    if best <= v0:
        raise ValueError(f"no gain to measure against: best {best} <= v0 {v0}")
    return [(t, (p - v0) / (best - v0)) for t, p in curve]


def values_at(curve: Curve, times: Sequence[float]) -> list[float]:
    """pass@1 at each of the ascending `times`, read off the straight lines between
    evaluations (the first point's value before it, the last point's after it; at a repeated
    time, the first of its points), in one pass over both: the segment that holds a time only
    moves forward as the times grow."""
    out: list[float] = []
    k = 1  # the first point at or after the time (its segment ends there)
    for t in times:
        if t <= curve[0][0]:
            out.append(curve[0][1])
            continue
        while k < len(curve) and curve[k][0] < t:
            k += 1
        if k == len(curve):
            out.append(curve[-1][1])
            continue
        (t0, p0), (t1, p1) = curve[k - 1], curve[k]
        out.append(p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0))
    return out


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The pointwise mean of piecewise-linear curves, exact at the union of their points
    (between two of those times every curve is linear, so their mean is too). Each curve is
    read at every time in one pass (`values_at`): the pooled figures' bootstrap averages
    dozens of curves of a hundred points or more, hundreds of times."""
    times = sorted({t for c in curves for t, _ in c})
    sums = [0.0] * len(times)
    for c in curves:
        for i, v in enumerate(values_at(c, times)):
            sums[i] += v
    return [(t, total / len(curves)) for t, total in zip(times, sums, strict=True)]


def pooled_time_to_gain(curves: Sequence[Curve], refs: Sequence[tuple[float, float]],
                        fraction: float = TARGET_FRACTION) -> float | None:
    """When the mean over repeats of the gain curves (`curves[i]` measured against its
    repeat's reference `(v0, best)` = `refs[i]`) first reaches `fraction`, interpolated.

    A seed's own first crossing hangs on one noisy evaluation near the target (256 samples
    give pass@1 a standard error of about 0.02, and a policy may dip below the target for a
    few versions): averaging the curves first leaves that noise to the mean of all repeats.
    """
    gains = [gain_curve(c, v0, best) for c, (v0, best) in zip(curves, refs, strict=True)]
    return time_to_reach_interpolated(mean_curve(gains), fraction)


def bootstrap_interval(statistic: Callable[[list[int]], float], n: int, draws: int = 2000,
                       level: float = 0.9, seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of a figure over `n` repeats: `statistic(idx)` is
    the figure on the repeats `idx` (indices into `range(n)`, drawn with replacement; it
    returns a number, infinity included, for every draw), computed on `draws` resamples;
    the (1 - level) / 2 and (1 + level) / 2 quantiles of those values. None below 2
    repeats."""
    if n < 2:
        return None
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return (values[int((1 - level) / 2 * (draws - 1))],
            values[math.ceil((1 + level) / 2 * (draws - 1))])


def binomial_se(p: float, n: int) -> float:
    """Standard error of a pass rate `p` measured on `n` independent samples,
    sqrt(p (1 - p) / n)."""
    if n <= 0:
        raise ValueError(f"need n >= 1 samples, got {n}")
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def samples_between(events: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Sum of the counts of the events `(time, count)` with `start < time <= end`."""
    return sum(n for t, n in events if start < t <= end)


def steady_samples_per_s(version_times: Sequence[float],
                         sample_events: Iterable[tuple[float, float]]) -> float | None:
    """Generated samples per second between the first and the last published version.

    `version_times`: when each policy version after the snapshot was published (any order);
    `sample_events`: `(time, samples)` per generation call, timed when it finished. The
    samples finished after the first version and up to the last, over the time between
    them: start-up (imports, model loading, the wait for the first batch) and the tail after
    the last version are left out. None with fewer than two versions or no time between them.
    """
    times = sorted(version_times)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return samples_between(sample_events, times[0], times[-1]) / (times[-1] - times[0])


def steps_per_s(version_times: dict[int, float], first: int, last: int) -> float | None:
    """Optimizer steps per second from version `first` to version `last`: `last - first`
    over the time between their publications (`version_times`: version -> seconds). None
    when either was not reached or no time passed between them."""
    start, end = version_times.get(first), version_times.get(last)
    if start is None or end is None or last <= first or end <= start:
        return None
    return (last - first) / (end - start)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics;
    None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def machine_share(cpu_s: dict[str, float], stages: Iterable[str], cores: int,
                  wall_s: float) -> float | None:
    """CPU seconds of `stages` (those present in `cpu_s`) over `cores x wall_s`: the share
    of the machine those stages kept busy. None without any of them or without wall time."""
    present = [cpu_s[s] for s in stages if s in cpu_s]
    if not present or cores <= 0 or wall_s <= 0:
        return None
    return sum(present) / (cores * wall_s)


def spread(values: Sequence[float | None], missing: str = "undefined") -> dict:
    """Median, min and max over repeats, and how many values were None.

    `missing` says what a None is. "undefined": left out (e.g. a figure whose inputs were
    not recorded). "high": worse than any number of a lower-is-better figure (a time ratio
    whose target was never reached), so it sorts above every number; "low": likewise for a
    higher-is-better figure (a speedup). A median, min or max that falls on a None is None;
    with an even count the median is the mean of the middle two, None if either is.
    """
    if missing not in ("undefined", "high", "low"):
        raise ValueError(f"missing must be 'undefined', 'high' or 'low', got {missing!r}")
    none = sum(v is None for v in values)
    ordered: list[float | None] = sorted(v for v in values if v is not None)
    if missing == "high":
        ordered = ordered + [None] * none
    elif missing == "low":
        ordered = [None] * none + ordered
    if not ordered:
        return {"median": None, "min": None, "max": None, "undefined": none}
    mid = len(ordered) // 2
    if len(ordered) % 2:
        median = ordered[mid]
    else:
        a, b = ordered[mid - 1], ordered[mid]
        median = None if a is None or b is None else (a + b) / 2
    return {"median": median, "min": ordered[0], "max": ordered[-1], "undefined": none}


def steady_busy_fraction(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Busy share of one process over [start, end] from its cumulative busy seconds
    `points` (unix time, busy seconds so far), in time order: the busy seconds gained
    between its first and last point inside the window over the time between them (start-up
    and the tail after the window are left out). None with fewer than two points inside."""
    inside = [(t, b) for t, b in points if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


Interval = tuple[float, float]
"""(start, end) in unix seconds."""


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The same time as disjoint intervals in order (empty and reversed ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """The time in both of two disjoint, ordered interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def idle_together(waits: Iterable[Interval], paused: Sequence[Iterable[Interval]],
                  window: Interval) -> float | None:
    """Share of `window` in which the learner waits for data (`waits`) while every rollout
    worker is paused on its backlog (`paused`, one list per worker): a hand-off bubble, the
    machine idling for the flow control's sake. None for an empty window or no workers."""
    if window[1] <= window[0] or not paused:
        return None
    both = intersect(union(waits), [window])
    for worker in paused:
        both = intersect(both, union(worker))
    return sum(b - a for a, b in both) / (window[1] - window[0])
