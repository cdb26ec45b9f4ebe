"""ScaleRL's compute -> performance curve: R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B).

R is the held-out pass rate, C the compute spent: cumulative learner tokens (response tokens
of the samples the learner trained on, `learn/tokens`), or FLOPs ~ 6 * parameters * tokens.
A is the asymptote (what the recipe reaches with unbounded compute), B the efficiency (how
sharply it gets there), C_mid the compute at which half of the gain A - R0 is reached.

R0 is the pass rate at C = 0 (the evaluation of policy v0) when there is one, and a free
parameter otherwise. Uncertainty comes from a bootstrap over the evaluation points.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass

import numpy as np

from ..store import RunKeys, Store
from .series import Metrics


def sigmoid(c, a: float, b: float, c_mid: float, r0: float) -> np.ndarray:
    """R(C) for compute `c` (N,); R(0) = R0."""
    c = np.asarray(c, dtype=np.float64)
    safe = np.where(c > 0, c, 1.0)
    with np.errstate(over="ignore"):
        ratio = np.where(c > 0, (c_mid / safe) ** b, np.inf)
    return r0 + (a - r0) / (1.0 + ratio)


@dataclass(frozen=True)
class ScalingFit:
    a: float
    b: float
    c_mid: float
    r0: float
    r0_fixed: bool
    """True when R0 is the measured pass rate at C = 0."""
    n_points: int
    a_ci: tuple[float, float] | None
    """95% bootstrap interval (None without bootstrap resamples)."""
    b_ci: tuple[float, float] | None
    c_mid_ci: tuple[float, float] | None
    n_boot: int
    """Bootstrap resamples that produced a fit."""
    residual_std: float
    at_bounds: tuple[str, ...] = ()
    """Parameters that ended on a bound of the search: the data do not pin them."""
    compute_range: tuple[float, float] | None = None
    """The compute of the points fitted: a C_mid outside it is an extrapolation."""

    def predict(self, c) -> np.ndarray:
        return sigmoid(c, self.a, self.b, self.c_mid, self.r0)

    def summary(self, flops_per_token: float | None = None) -> str:
        def ci(v: tuple[float, float] | None, fmt: str) -> str:
            return f" [{v[0]:{fmt}}, {v[1]:{fmt}}]" if v else ""

        flops = (f" = {self.c_mid * flops_per_token:.3g} FLOPs" if flops_per_token else "")
        return (f"A (asymptote) {self.a:.3f}{ci(self.a_ci, '.3f')}, "
                f"B (efficiency) {self.b:.2f}{ci(self.b_ci, '.2f')}, "
                f"C_mid {self.c_mid:.3g} tokens{ci(self.c_mid_ci, '.3g')}{flops}, "
                f"R0 {self.r0:.3f} ({'measured at C=0' if self.r0_fixed else 'fitted'}); "
                f"{self.n_points} eval points, {self.n_boot} bootstrap fits, "
                f"residual std {self.residual_std:.3g}"
                + (f"; at a bound, not pinned by the data: {', '.join(self.at_bounds)}"
                   if self.at_bounds else "")
                + (f"; C_mid outside the compute fitted ({self.compute_range[0]:.3g} to "
                   f"{self.compute_range[1]:.3g} tokens): an extrapolation"
                   if self.compute_range and not (self.compute_range[0] <= self.c_mid
                                                  <= self.compute_range[1]) else ""))


@dataclass(frozen=True)
class NotEnoughData:
    n_points: int
    """Held-out evaluations past the early phase (the ones a fit would use)."""
    needed: int
    skip_fraction: float = 0.0
    """Evaluations before this fraction of the run's compute do not count."""
    reason: str = ""
    """Why there is no fit when it is not the number of points (no fit converged)."""

    def summary(self, flops_per_token: float | None = None) -> str:
        if self.reason:
            return f"no scaling fit: {self.reason}"
        early = (f" past the first {self.skip_fraction:.0%} of compute"
                 if self.skip_fraction > 0 else "")
        return (f"not enough data for the scaling fit: {self.n_points} held-out evaluation(s)"
                f"{early}, at least {self.needed} needed (evaluate more often: eval.every)")


def _bounds(c: np.ndarray, free_r0: bool) -> tuple[list[float], list[float]]:
    """Bounds of (a, b, log c_mid[, r0]): pass rates in [0, 1], C_mid within e^5 of the data."""
    lc_lo, lc_hi = math.log(c.min()) - 5, math.log(c.max()) + 5
    lower, upper = [0.0, 0.05, lc_lo], [1.0, 10.0, lc_hi]
    return (lower + [0.0], upper + [1.0]) if free_r0 else (lower, upper)


def _fit_once(c: np.ndarray, r: np.ndarray, r0: float | None, starts: list[np.ndarray]):
    """Least-squares (a, b, log c_mid[, r0]) from several starts; None if none converged."""
    from scipy.optimize import OptimizeWarning, curve_fit

    lower, upper = _bounds(c, r0 is None)

    def model(x, a, b, lc, *rest):
        return sigmoid(x, a, b, math.exp(lc), rest[0] if rest else r0)

    best, best_sse = None, math.inf
    for p0 in starts:
        p0 = np.clip(p0[: len(lower)], np.array(lower) + 1e-9, np.array(upper) - 1e-9)
        try:
            with warnings.catch_warnings():  # the covariance is not used: intervals come
                warnings.simplefilter("ignore", OptimizeWarning)  # from the bootstrap
                p, _ = curve_fit(model, c, r, p0=p0, bounds=(lower, upper), maxfev=5000)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((model(c, *p) - r) ** 2))
        if sse < best_sse:
            best, best_sse = p, sse
    return best


def fit_scaling(compute, pass_rate, min_points: int = 6, n_boot: int = 200,
                seed: int = 0, skip_fraction: float = 0.1) -> ScalingFit | NotEnoughData:
    """Fit the sigmoid to (compute (N,), pass rate (N,)) points; a point at C = 0 fixes R0.

    As ScaleRL fits only past the early, transient phase, points with
    0 < C < `skip_fraction` x the largest C are left out; at least `min_points` points (and
    more distinct C values than free parameters) must remain, else NotEnoughData says so.
    """
    c, r = np.asarray(compute, dtype=np.float64), np.asarray(pass_rate, dtype=np.float64)
    ok = np.isfinite(c) & np.isfinite(r) & (c >= 0)
    c, r = c[ok], r[ok]
    zero = c == 0
    r0 = float(np.mean(r[zero])) if zero.any() else None
    late = c >= skip_fraction * c.max() if len(c) else zero
    pos = late & ~zero
    n_free = 3 if r0 is not None else 4
    if pos.sum() < min_points or len(np.unique(c[pos])) < n_free:
        return NotEnoughData(int(pos.sum()), max(min_points, n_free), skip_fraction)
    cp, rp = c[pos], r[pos]
    starts = [np.array([max(rp.max(), 1e-3), b, math.log(q), r0 if r0 is not None else rp.min()])
              for b in (0.5, 1.0, 2.0) for q in np.quantile(cp, [0.25, 0.5, 0.75])]
    best = _fit_once(cp, rp, r0, starts)
    if best is None:
        return NotEnoughData(len(cp), min_points, skip_fraction,
                             reason=f"no least-squares fit converged on {len(cp)} points")
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(cp), len(cp))
        if len(np.unique(cp[idx])) < n_free:
            continue
        p = _fit_once(cp[idx], rp[idx], r0, [best])
        if p is not None:
            boots.append(p)
    a, b, lc = best[:3]
    fit_r0 = r0 if r0 is not None else float(best[3])
    resid = sigmoid(cp, a, b, math.exp(lc), fit_r0) - rp

    def interval(col: int, transform=float) -> tuple[float, float] | None:
        if not boots:
            return None
        lo, hi = np.percentile([p[col] for p in boots], [2.5, 97.5])
        return transform(lo), transform(hi)

    gain, noise = a - fit_r0, float(np.std(resid))
    a_ci = interval(0)
    if abs(gain) <= 2 * noise or (r0 is not None and a_ci and a_ci[0] <= r0 <= a_ci[1]):
        # B and C_mid shape a gain there is none of: the fit would report its start
        return NotEnoughData(len(cp), min_points, skip_fraction, reason=(
            f"no measurable gain over R0 {fit_r0:.3f} (A - R0 = {gain:+.3f}, residual std "
            f"{noise:.3g}{'' if a_ci is None else f', A within [{a_ci[0]:.3f}, {a_ci[1]:.3f}]'}"
            f"): the pass rate did not move with compute, so B and C_mid are undetermined"))
    lower, upper = _bounds(cp, r0 is None)
    at_bounds = tuple(name for name, v, lo, hi in zip(("A", "B", "C_mid", "R0"), best, lower,
                                                       upper, strict=False)
                      if min(v - lo, hi - v) <= 1e-6 * (hi - lo))
    return ScalingFit(a=float(a), b=float(b), c_mid=math.exp(lc), r0=fit_r0,
                      r0_fixed=r0 is not None, n_points=len(cp), a_ci=a_ci,
                      b_ci=interval(1), c_mid_ci=interval(2, math.exp), n_boot=len(boots),
                      residual_std=noise, at_bounds=at_bounds,
                      compute_range=(float(cp.min()), float(cp.max())))


def eval_points(m: Metrics) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(versions, cumulative learner tokens, held-out pass@1) at each evaluated version (N,)."""
    ev, tok = m.get("evaluate/pass_at_1"), m.get("learn/tokens")
    if ev is None:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    ev = ev.finite()
    steps = tok.steps if tok is not None else np.zeros(0, np.int64)
    values = np.nan_to_num(tok.values) if tok is not None else np.zeros(0)
    cumulative = np.array([values[steps <= v].sum() for v in ev.steps], dtype=np.float64)
    return ev.steps, cumulative, ev.values


def param_count(store: Store, keys: RunKeys) -> int | None:
    """Parameters of the run's initial policy, from its safetensors headers (None if absent)."""
    total, found = 0, False
    for key in store.list(keys.policy_prefix(0)):
        if not key.endswith(".safetensors"):
            continue
        blob = store.get_bytes(key)
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8: 8 + n])
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
        found = True
    return total if found else None
