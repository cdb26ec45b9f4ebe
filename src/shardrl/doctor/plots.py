"""The report's figures (matplotlib, Agg backend): one PNG per view of the run.

Every figure is written even when its metrics were never logged (KL off, no critic): it then
says which metrics are missing, so the report always has the same pages.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..config import RunConfig  # noqa: E402
from .fit import NotEnoughData, ScalingFit  # noqa: E402
from .series import Metrics, Series  # noqa: E402

Line = tuple[str, str]
"""(metric name, label)"""


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _placeholder(path: Path, title: str, message: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    ax.set_axis_off()
    return _save(fig, path)


def _draw(ax, m: Metrics, lines: list[Line], style: str = "-", first_color: int = 0) -> None:
    for i, (name, label) in enumerate(lines):
        s: Series | None = m.get(name)
        if s is not None and len(s):
            ax.plot(s.steps, s.values, style, color=f"C{(first_color + i) % 10}", label=label,
                    marker="." if len(s) < 30 else None)


def line_plot(path: Path, m: Metrics, title: str, lines: list[Line], ylabel: str,
              right: tuple[Line, ...] = (), right_label: str = "",
              symlog: float | None = None, hlines: tuple[tuple[float, str], ...] = ()) -> Path:
    """Metric series against the policy version; `right` ones on a second y axis; `symlog`:
    a log y axis, linear within +-symlog (values span decades and can be 0)."""
    if not any(m.get(n) is not None for n, _ in lines):
        return _placeholder(path, title,
                            "no data: " + ", ".join(n for n, _ in lines) + " not logged")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    _draw(ax, m, lines)
    for y, label in hlines:
        ax.axhline(y, color="grey", ls=":", lw=1, label=label)
    ax.set(title=title, xlabel="policy version", ylabel=ylabel)
    if symlog is not None:
        ax.set_yscale("symlog", linthresh=symlog)
    handles, labels = ax.get_legend_handles_labels()
    if right and any(m.get(n) is not None for n, _ in right):
        ax2 = ax.twinx()
        _draw(ax2, m, list(right), style="--", first_color=len(lines))
        ax2.set_ylabel(right_label)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")
    return _save(fig, path)


def staleness_plot(path: Path, histogram: dict[int, int]) -> Path:
    """Bars: admitted samples by version lag (learner version - generating version)."""
    title = "Staleness of admitted samples"
    if not histogram:
        return _placeholder(path, title, "no data: the learner recorded no staleness histogram")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    lags = sorted(histogram)
    ax.bar(lags, [histogram[k] for k in lags])
    ax.set(title=title, xlabel="version lag", ylabel="samples", xticks=lags)
    return _save(fig, path)


def pass_rate_distribution_plot(path: Path, rates: list[tuple[int, float]]) -> Path:
    """Histograms of per-prompt-group pass rates, early third vs last third of versions."""
    title = "Per-prompt pass-rate distribution (training groups)"
    if not rates:
        return _placeholder(path, title, "no data: no scored shards")
    versions = np.array([v for v, _ in rates])
    values = np.array([r for _, r in rates])
    lo, hi = np.quantile(versions, [1 / 3, 2 / 3])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bins = np.linspace(0, 1, 11)
    ax.hist(values[versions <= lo], bins=bins, alpha=0.6, label=f"versions <= {lo:.0f}")
    ax.hist(values[versions >= hi], bins=bins, alpha=0.6, label=f"versions >= {hi:.0f}")
    ax.set(title=title, xlabel="pass rate of a prompt's group", ylabel="groups")
    ax.legend(fontsize=7)
    return _save(fig, path)


def fit_plot(path: Path, compute: np.ndarray, pass_rate: np.ndarray,
             fit: ScalingFit | NotEnoughData, flops_per_token: float | None) -> Path:
    """Eval points against compute with the fitted sigmoid, extrapolated to 10x the data."""
    title = "Held-out pass@1 vs compute (ScaleRL sigmoid)"
    if isinstance(fit, NotEnoughData):
        return _placeholder(path, title, fit.summary())
    pos = compute > 0
    c = np.logspace(np.log10(compute[pos].min()), np.log10(compute[pos].max() * 10), 200)
    seen = c <= compute.max()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(compute[pos], pass_rate[pos], "o", label="evaluations")
    ax.plot(c[seen], fit.predict(c[seen]), "-", label="fit")
    ax.plot(c[~seen], fit.predict(c[~seen]), "--", label="extrapolation")
    ax.axhline(fit.a, color="grey", ls=":", lw=1, label=f"A = {fit.a:.3f}")
    if fit.a_ci:
        ax.axhspan(*fit.a_ci, color="grey", alpha=0.15)
    if (~pos).any():
        ax.axhline(fit.r0, color="tab:red", ls=":", lw=1, label=f"R0 (v0) = {fit.r0:.3f}")
    ax.axvline(fit.c_mid, color="tab:green", ls=":", lw=1, label=f"C_mid = {fit.c_mid:.3g}")
    ax.set_xscale("log")
    ax.set(title=title, xlabel="learner tokens", ylabel="pass@1")
    if flops_per_token:
        top = ax.secondary_xaxis("top", functions=(lambda x: x * flops_per_token,
                                                   lambda x: x / flops_per_token))
        top.set_xlabel("FLOPs (6 x params x tokens)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def metric_plots(out: Path, m: Metrics, cfg: RunConfig) -> dict[str, Path]:
    """The line plots of the report: {title: PNG path}."""
    d = cfg.doctor
    cats = [(n, n.rsplit("/", 1)[1]) for n in m.names() if n.startswith("evaluate/pass_at_1/")]
    specs = [
        ("reward.png", "Reward", [("score/reward_rm_mean", "reward_rm (train)"),
                                  ("prepare/reward_total_mean", "reward_total (shaped)"),
                                  ("evaluate/mean_reward", "held-out mean reward")], "reward", {}),
        ("pass_rate.png", "Pass rate", [("score/pass_rate", "train (verifier)"),
                                        ("evaluate/pass_at_1", "held-out pass@1"), *cats],
         "pass rate", {}),
        ("kl_beta.png", "KL to the reference, with beta", [
            ("learn/kl_sum", "kl_sum"), ("learn/kl_mean", "kl_mean")], "KL",
         {"right": (("learn/beta", "beta"),), "right_label": "beta", "symlog": 1e-4}),
        ("entropy.png", "Entropy", [("learn/entropy", "entropy (nats/token)")], "entropy", {}),
        ("clip_fraction.png", "Clip fraction", [("learn/clip_frac", "policy clip_frac"),
                                                ("learn/vf_clip_frac", "value clip_frac")],
         "fraction", {"hlines": ((d.clip_frac_high, "doctor: high"),)}),
        ("lengths.png", "Response length", [
            ("rollout/response_length_mean", "mean"), ("rollout/response_length_p50", "p50"),
            ("rollout/response_length_p90", "p90"), ("rollout/response_length_max", "max"),
            ("evaluate/mean_length", "held-out mean")], "tokens",
         {"right": (("rollout/truncation_rate", "truncation rate"),), "right_label": "rate"}),
        ("effective_sample_rate.png", "Effective sample rate",
         [("prepare/effective_sample_rate", "kept after filtering"),
          ("prepare/filter_rate", "filtered")], "fraction",
         {"hlines": ((d.filter_rate_high, "doctor: filter rate high"),)}),
        ("grad_norm.png", "Gradient norm (before clipping)", [("learn/grad_norm", "grad_norm")],
         "norm", {"symlog": 1e-2, "hlines": ((cfg.learner.grad_clip, "grad_clip"),)
                  if cfg.learner.grad_clip else ()}),
    ]
    return {title: line_plot(out / name, m, title, lines, ylabel, **kw)
            for name, title, lines, ylabel, kw in specs}
