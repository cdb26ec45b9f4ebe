"""TRL's GRPOTrainer, a synchronous baseline and ShardRL on the same SFT snapshot and budget.

One repeat: run the `demo` pipeline (it builds the SFT snapshot, then its RL phase is
ShardRL's curve); then, each in a fresh process started from that snapshot's
`policy/v000000/` folder and for as long as ShardRL's RL phase lasted, train TRL's
`GRPOTrainer` and the synchronous baseline of `bench/sync_baseline.py` (ShardRL's own
generation engine, verifier, advantages, filtering, loss and optimizer in one process, no
object store). All three get the same task (the cipher task's training prompt stream and
verifier), group size, prompts per optimizer step, learning rate and schedule, AdamW betas,
gradient clip, sampling temperature and response length, all read from the one run config.
Held-out pass@1 is measured the same way for all (all held-out prompts, `samples_per_prompt`
each, the evaluate stage's engine and sampling seed), which gives pass@1 versus RL wall clock
for each system, and samples generated per second.

The comparison is the one a user of this machine sees: ShardRL's RL phase is concurrent
processes (rollout, score, prepare, learn; one torch thread each) on all cores; TRL and the
baseline are one process each. No side's evaluations count against its training: the peers'
clocks pause while they are evaluated, and ShardRL's evaluate stage waits until its learner
has finished (`eval.when: after`; `--eval-during` evaluates beside the training instead, as
`make run` does, which then shares the training's cores). With `eval.when: after` the
baseline also evaluates after its training (`sync_baseline --eval-after`: it copies its
weights at each point, its clock paused), so that evaluations as dense as ShardRL's do not run
between its steps. ShardRL evaluates every `--eval-every` versions and the baseline as often
in time; TRL, which evaluates in place at its points (its clock paused), every
`--trl-eval-every` versions' worth of ShardRL's time. TRL uses all cores
(`torch.set_num_threads(os.cpu_count())`). The baseline runs every repeat once per thread
count (`--sync-threads`; by default 1 and one per core, in alternating order), and the count
that reaches its own 70% target soonest on the mean of the repeats' gain curves is the
baseline all figures compare with (`choose_baseline`): which is faster depends on the model
and the host (at the demo's size two threads won on some hosts here and lost on others), and
a user would tune it before comparing. Every process waits for OpenMP work passively
(`OMP_WAIT_POLICY=PASSIVE` unless the environment sets it), as the local runner makes
ShardRL's stages do: with active waiting, idle threads spin on cores others need.
ShardRL's clock starts when its snapshot is published (`run.json`) and stops at `DONE.json`;
a point of its curve is the time its policy version was published. The snapshot stage
evaluates version 0 before it publishes it, so that evaluation is off ShardRL's clock as the
peers' evaluation at t=0 is off theirs.
Its stages are forked from a runner that imported their libraries, paid their first-call
costs on a throwaway model and built the task before the snapshot, and they start while the
snapshot runs. The rollout workers and the learner load policy v0 as soon as the snapshot
has uploaded it, while it evaluates v0 (when that evaluation is the shorter, the rest of the
load counts); the engine, the optimizer, the first shards and the first step count,
importing torch and transformers does not. TRL and the baseline run in fresh processes whose
clocks start once those libraries (and TRL) are imported, the same warm-up and task building
are done (`sync_baseline.before_clock`) and the snapshot's model and tokenizer are loaded
(`sync_baseline.load_snapshot`): setting up the trainer counts, as for ShardRL.

Repeat r runs with `seed` = the config's seed + r on all sides (the SFT snapshot, the
prompt streams, sampling and initialisation), so the repeats are independent samples of each
comparison; `--same-seed` repeats one seed instead, which on this deterministic CPU setup
gives nearly the same curves every time and measures timing noise only. `--sync-repeats N`
adds N repeats of ShardRL and the baseline alone (seeds continuing after the others): the
time to a target moves much more from seed to seed than the timings do, and a baseline
repeat costs a small share of a TRL one.

Figures per repeat (each reported as median, min and max over repeats):
- `target_time_ratio`: v0 = the snapshot's pass@1 (TRL's curve point at t=0) and target =
  v0 + 0.7 x (TRL's best pass@1 - v0); ShardRL's first measured time at or above the target
  over TRL's (None: ShardRL never reached it, counted as worse than any ratio).
- `samples_per_s_ratio`: ShardRL's generated samples per second of its RL phase over TRL's
  samples per second of its clock (both whole runs, start-up included).
- `time_ratio`, `pass_gap`: ShardRL's time to TRL's *final* pass@1 over TRL's final time, and
  ShardRL's pass@1 at that time minus TRL's final pass@1.
- `vs_sync.time_speedup`: the same kind of target from the baseline's curve (v0 and best of
  the baseline); the baseline's time to it over ShardRL's (None when ShardRL never got there,
  counted as worse than any speedup).
- `pooled`, over all repeats at once: each repeat's curves become shares of the reference
  run's gain ((pass@1 - v0) / (best - v0), TRL or the baseline), the shares are averaged over
  repeats, and each side's time to 0.7 is read off the mean curve (`target_time_ratio`:
  ShardRL / TRL; `sync_time_speedup`: baseline / ShardRL). A repeat's own first crossing
  hangs on one evaluation near the target, whose noise (about 0.02 at n = 256) and dips move
  it by a whole evaluation interval; the mean curve leaves less of that noise. Beside each,
  its 90% percentile-bootstrap interval over repeats (`pooled_interval`): the range other
  seeds could give.
- `vs_sync.samples_per_s_ratio`: steady-state samples per second, ShardRL's over the
  baseline's, each = generated samples finished between its first and its last new policy
  version over the time between them (`bench.curves.steady_samples_per_s`; ShardRL: from the
  learner's per-step and the rollout's per-shard metric times; the baseline: on its clock).
  `samples_per_s_ratio_whole_run` divides the whole-run rates instead.
- `vs_sync.early_steps_per_s_ratio` and `vs_sync.versions_to_target_ratio`: the time speedup
  taken apart. The first is ShardRL's optimizer steps per second over the baseline's between
  versions 1 and 30 (`EARLY_VERSIONS`), where the target is crossed; the second the versions
  the baseline needed to reach the target over ShardRL's, each read between its evaluations.
  Start-up aside, their product is the speedup: a ShardRL step comes faster, and learns less
  when its samples are a version or more old.
- `vs_sync.early_update_cpu_ms` and `vs_sync.early_rows_per_step` (each side), and
  `early_busy_fraction` (ShardRL): the same versions taken apart further. The CPU
  milliseconds of an update and the kept rows it trains on, per step after version 1 up to
  version 30 (ShardRL: the learner's `busy_cpu_s` and `samples`; the baseline: per step on
  its clock), and ShardRL's busy fractions over that window as in `steady_busy_fraction`
  below. Early on most groups are kept, so a step takes two shards and trains on more rows
  than late in the run; whichever of the learner and the workers is busier there sets
  ShardRL's step rate.
- `machine_share`: CPU seconds of ShardRL's rollout, score, prepare, learn and evaluate
  processes over the RL phase (`rl_cpu_s` of `state/runner/summary.json`: the runner samples
  them when it starts supervising the looping stages and when it first sees DONE.json) over
  `os.cpu_count() x rl_window_s`, the time between those samples. Runs recorded before that
  sampling give their whole lives' CPU (`cpu_s`, start-up included) over `rl_wall_s`.
- `cpu_per_step` (each side) and `vs_sync.cpu_per_step_ratio`: CPU seconds per optimizer
  step over the whole RL phase, split into the model's work (sampling calls, updates) and the
  rest: for ShardRL those processes' CPU seconds (`cpu_per_step`) with the rollout workers'
  `sampling_cpu_s`, the learner's `busy_cpu_s` and the evaluate stage apart; for the
  baseline the process CPU of its sampling calls, of drawing prompts and building tables, of
  scoring and prepare, and of updates (its evaluations are off the clock). The ratio leaves
  ShardRL's evaluate stage out too (`training_cpu`), so both sides count training. What ShardRL
  spends beyond the baseline per step is what its concurrency has to win back: its steps/s
  over the baseline's is the ratio of the cores each keeps busy divided by this ratio (up to
  start-up, which only ShardRL's figure holds).
- `steady_busy_fraction` (rollout, learner: busy seconds gained between the first and the last
  new version over that time; a rollout worker is busy whenever it is not paused on its
  backlog, and `rollout_generating` counts only its generation batches; `learner_cpu` counts
  the learner's CPU seconds of updates, so an update slowed by a shared core is not counted
  busier), `busy_fraction` (whole-run values,
  start-up included), `resume_lag_s` (a paused worker: the learner's commit to its resuming)
  and `hop_s`
  (the learner's hand-off latency: seconds from a shard's generation to the learner reading
  its ready shard; the learner logs each step's median and maximum; `p50` and `p95` are over
  those per-step medians, `max` the largest), read from the run's metric chunks when the
  stages report them.

What still differs between TRL and ShardRL (TRL 1.16 has no equivalent, or the config has no
TRL mapping):
- TRL's `dapo` loss (PPO's clip, the demo's loss) averages over all completion tokens of the
  batch, as its `cispo` does; ShardRL's demo uses prompt-level aggregation (each group's token
  mean, then the mean over groups).
- TRL keeps groups whose rewards are all equal in its 16-prompt batch (advantage 0, their
  tokens still count in the loss denominator); ShardRL and the baseline filter them out and
  fill each step with 16 groups that carry signal, so they generate more samples per step.
- TRL and the baseline train on-policy (one update per generation batch, ratio 1); ShardRL
  learns from samples up to k=8 versions old, its ratio to the behaviour policy clipped to
  1 +- 0.2 (or, with CISPO, the weight capped at `max_ratio`).
- All normalise advantages by the batch std (TRL adds 1e-4 to it); none has a KL term.

    .venv/bin/python -m bench.trl_bench --repeats 3
    .venv/bin/python -m bench.trl_bench --snapshot DIR --budget 90 --out trl.json  # TRL only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.curves import (
    Curve,
    binomial_se,
    bootstrap_interval,
    idle_together,
    machine_share,
    pass_at,
    percentile,
    pooled_time_to_gain,
    ratio,
    spread,
    steady_busy_fraction,
    steady_samples_per_s,
    steps_per_s,
    time_to_reach,
    time_to_reach_interpolated,
    time_to_target,
)

WORK = Path(__file__).parent / "_work" / "trl"
MACHINE_STAGES = ("rollout", "score", "prepare", "learn", "evaluate")
"""ShardRL's RL-phase stages whose CPU time counts in its machine share."""
LEARNER_STAGES = ("learn", "learner")
"""Metric namespaces the learner's figures may come under."""
EARLY_VERSIONS = (1, 30)
"""The versions between which each side's early steps/s are read (`vs_sync.early_steps_per_s`):
on the demo both systems cross the baseline's 70% target between about version 10 and 50."""


# -- curve figures (pure) ------------------------------------------------------------------
def compare(shardrl: Curve, trl: Curve) -> dict:
    """ShardRL's figures against TRL's curve (each starts at the shared snapshot, t=0).

    `time_ratio`: time ShardRL needed to reach TRL's final pass@1, over TRL's final time
    (None when ShardRL never reached it). `pass_gap`: ShardRL's pass@1 at TRL's final time
    minus TRL's final pass@1. `target_time_ratio`: first measured times at or above
    v0 + 0.7 x (TRL's best - v0), ShardRL's over TRL's (None when ShardRL never reached it,
    or TRL gained nothing over v0). Each side's best pass@1 is reported beside them, since
    neither curve needs to rise monotonically.
    """
    trl_time, trl_pass = trl[-1]
    reach = time_to_reach(shardrl, trl_pass)
    target = time_to_target(trl, shardrl)
    trl_t, shardrl_t = target["seconds"]
    trl_x, shardrl_x = target["crossing"]
    return {"trl_final_pass": trl_pass, "trl_final_seconds": trl_time,
            "trl_best_pass": max(p for _, p in trl),
            "shardrl_best_pass": max(p for _, p in shardrl),
            "shardrl_seconds_to_trl_final": reach,
            "time_ratio": ratio(reach, trl_time),
            "pass_gap": pass_at(shardrl, trl_time) - trl_pass,
            "v0": target["v0"], "target": target["target"],
            "trl_seconds_to_target": trl_t, "shardrl_seconds_to_target": shardrl_t,
            "target_time_ratio": ratio(shardrl_t, trl_t),
            "trl_crossing_s": trl_x, "shardrl_crossing_s": shardrl_x,
            "target_time_ratio_interpolated": ratio(shardrl_x, trl_x)}


def compare_sync(shardrl: dict, sync: dict) -> dict:
    """ShardRL against the synchronous baseline (both sides' results, curves included).

    `time_speedup`: the baseline's first measured time at or above v0 + 0.7 x (its best - v0)
    over ShardRL's (None when ShardRL never reached it); `time_speedup_interpolated`: the
    same with each curve's crossing read between its evaluations
    (`curves.time_to_reach_interpolated`). `samples_per_s_ratio`: steady-state
    samples/s, ShardRL's over the baseline's; `samples_per_s_ratio_whole_run`: whole runs.
    `cpu_per_step_ratio`: CPU seconds per optimizer step, ShardRL's (its RL processes but
    the evaluate stage) over the baseline's; `samples_per_step`: generated samples per step of each.

    The time speedup is, start-up aside, the product of two figures: `early_steps_per_s_ratio`,
    ShardRL's steps/s over the baseline's between `EARLY_VERSIONS` (each side's
    `version_times`, or the baseline's `step_times`), and `versions_to_target_ratio`, the
    versions the baseline needed to reach the target over ShardRL's, each read between its
    evaluations (`version_curve`, or the baseline's `curve_versions`): below 1 when a
    ShardRL step, trained on samples of older versions, learned less than an on-policy one.
    Either is None when a side lacks the figures or never got there.
    """
    target = time_to_target(sync["curve"], shardrl["curve"])
    sync_t, shardrl_t = target["seconds"]
    sync_x, shardrl_x = target["crossing"]
    sync_times = {i + 1: t for i, t in enumerate(sync.get("step_times") or [])}
    early = {"shardrl": steps_per_s(version_times(shardrl), *EARLY_VERSIONS),
             "sync": steps_per_s(sync_times, *EARLY_VERSIONS)}
    sync_versions = sync.get("curve_versions")
    curves = {"shardrl": shardrl.get("version_curve"),
              "sync": None if sync_versions is None else
              [(float(v), p) for v, (_, p) in zip(sync_versions, sync["curve"], strict=True)]}
    versions = {side: None if curve is None or target["target"] is None
                else time_to_reach_interpolated(curve, target["target"])
                for side, curve in curves.items()}
    return {"v0": target["v0"], "sync_best_pass": target["best"], "target": target["target"],
            "sync_seconds_to_target": sync_t, "shardrl_seconds_to_target": shardrl_t,
            "time_speedup": ratio(sync_t, shardrl_t),
            "sync_crossing_s": sync_x, "shardrl_crossing_s": shardrl_x,
            "time_speedup_interpolated": ratio(sync_x, shardrl_x),
            "samples_per_s_ratio": ratio(shardrl.get("steady_samples_per_s"),
                                         sync.get("steady_samples_per_s")),
            "samples_per_s_ratio_whole_run": ratio(shardrl["samples_per_s"],
                                                   sync["samples_per_s"]),
            "cpu_per_step_ratio": ratio(training_cpu(shardrl.get("cpu_per_step")),
                                        (sync.get("cpu_per_step") or {}).get("total")),
            "samples_per_step": {side: r["samples"] / r["steps"] if r.get("steps") else None
                                 for side, r in (("shardrl", shardrl), ("sync", sync))},
            "early_steps_per_s": early,
            "early_steps_per_s_ratio": ratio(early["shardrl"], early["sync"]),
            "early_update_cpu_ms": {"shardrl": shardrl.get("early", {}).get("update_cpu_ms"),
                                    "sync": early_mean(sync.get("step_update_cpu_s"), 1000.0)},
            "early_rows_per_step": {"shardrl": shardrl.get("early", {}).get("rows"),
                                    "sync": early_mean(sync.get("step_rows"))},
            "versions_to_target": versions,
            "versions_to_target_ratio": ratio(versions["sync"], versions["shardrl"])}


def early_mean(per_step: list[float] | None, scale: float = 1.0) -> float | None:
    """The mean of a per-step list of the baseline (entry i: the step that made version i +
    1) over the steps after version `EARLY_VERSIONS[0]` up to `EARLY_VERSIONS[1]`, times
    `scale`; None when the list is missing or shorter."""
    lo, hi = EARLY_VERSIONS
    if not per_step or len(per_step) < hi:
        return None
    return scale * sum(per_step[lo:hi]) / (hi - lo)


def version_times(shardrl: dict) -> dict[int, float]:
    """ShardRL's `version_times` (version -> seconds since its RL phase began), with the
    versions as integers again after a trip through JSON."""
    return {int(v): t for v, t in (shardrl.get("version_times") or {}).items()}


# -- ShardRL side --------------------------------------------------------------------------
Point = tuple[str, str, int, float, float]
"""(writer `<stage>/wNN`, metric name, step, value, unix time) of one metric point."""


def named(points: list[Point], stages: tuple[str, ...], name: str) -> list[Point]:
    """The points of metric `name` under any of the namespaces `stages`, in time order."""
    names = {f"{stage}/{name}" for stage in stages}
    return sorted((p for p in points if p[1] in names), key=lambda p: p[4])


def newest_per_writer(points: list[Point]) -> list[float]:
    """Each writer's newest value (of a running figure, one per stage process)."""
    newest: dict[str, Point] = {}
    for p in points:
        if p[0] not in newest or p[4] >= newest[p[0]][4]:
            newest[p[0]] = p
    return [p[3] for p in newest.values()]


def last_per_writer(points: list[Point]) -> float | None:
    """Mean over writers of each writer's newest value (a whole-run running figure such
    as a busy fraction, one per stage process); None without points."""
    values = newest_per_writer(points)
    return sum(values) / len(values) if values else None


def pipeline_figures(points: list[Point]) -> dict:
    """Steady-state samples/s, busy fractions and hop latency of a run from its metrics.

    A version's publication time is the time of the learner's first step metric at that
    version (`update_s`, logged as the step commits); generated samples are the rollout's
    per-shard `samples`, timed when the shard was generated. Hop latency: percentiles of
    the learner's per-step median `hop_s`, and the largest per-step `hop_max_s`. Figures the
    stages did not report are None.
    """
    published = published_times(points)
    samples = [(t, v) for _, _, _, v, t in named(points, ("rollout",), "samples")]
    hops = [v for _, _, _, v, _ in named(points, LEARNER_STAGES, "hop_s")]
    hop_max = [v for _, _, _, v, _ in named(points, LEARNER_STAGES, "hop_max_s")]
    resumes = [v for _, _, _, v, _ in named(points, ("rollout",), "resume_lag_s")]
    window = (min(published.values()), max(published.values())) if published else (0.0, 0.0)
    return {
        "steady_samples_per_s": steady_samples_per_s(list(published.values()), samples),
        "busy_fraction": {
            "rollout": last_per_writer(named(points, ("rollout",), "busy_fraction")),
            "learner": last_per_writer(named(points, LEARNER_STAGES, "busy_fraction"))},
        "steady_busy_fraction": busy_fractions(points, window),
        "hop_s": {"p50": percentile(hops, 50), "p95": percentile(hops, 95),
                  "max": max(hop_max, default=None), "n": len(hops)},
        "resume_lag_s": {"p50": percentile(resumes, 50), "p95": percentile(resumes, 95),
                         "n": len(resumes)},
        "profile": step_profile(points, window),
        "idle_together": idle_together(learner_waits(points),
                                       rollout_pauses(points), window),
        "early": early_figures(points, published),
    }


BUSY_FIGURES = ("rollout", "rollout_generating", "learner", "learner_cpu")
"""The keys of `busy_fractions`."""


def busy_fractions(points: list[Point], window: tuple[float, float]) -> dict:
    """The rollout workers' (mean) and the learner's busy fractions over `window` (see
    `steady_busy`): rollout not paused and inside generation batches, learner wall and CPU
    seconds of updates."""
    return {
        "rollout": steady_busy(named(points, ("rollout",), "busy_s"), window),
        "rollout_generating": steady_busy(named(points, ("rollout",), "generating_s"), window),
        "learner": steady_busy(named(points, LEARNER_STAGES, "busy_s"), window),
        "learner_cpu": steady_busy(named(points, LEARNER_STAGES, "busy_cpu_s"), window)}


def learner_per_step(points: list[Point], name: str) -> dict[int, float]:
    """{step: value} of a learner metric, the first logged per step (the leader's, or the
    only learner's)."""
    out: dict[int, float] = {}
    for _, _, step, value, _ in named(points, LEARNER_STAGES, name):
        out.setdefault(step, value)
    return out


def early_figures(points: list[Point], published: dict[int, float]) -> dict:
    """Where the targets are crossed, between versions `EARLY_VERSIONS`: `busy_fractions`
    over that window, and the learner's CPU milliseconds of updates and kept rows per step
    (`update_cpu_ms`, `rows`: the steps after the first version up to the last). Empty when
    the run did not reach the last version."""
    lo, hi = EARLY_VERSIONS
    if lo not in published or hi not in published:
        return {}
    cpu, rows = learner_per_step(points, "busy_cpu_s"), learner_per_step(points, "samples")
    steps = range(lo + 1, hi + 1)
    return {
        "busy_fraction": busy_fractions(points, (published[lo], published[hi])),
        "update_cpu_ms": (1000.0 * (cpu[hi] - cpu[lo]) / (hi - lo)
                          if lo in cpu and hi in cpu else None),
        "rows": (sum(rows[v] for v in steps) / len(steps)
                 if all(v in rows for v in steps) else None),
    }


def published_times(points: list[Point]) -> dict[int, float]:
    """Each policy version's publication time (unix seconds): the time of the learner's
    first step metric at that version (`update_s`, logged as the step commits)."""
    published: dict[int, float] = {}
    for _, _, step, _, t in named(points, LEARNER_STAGES, "update_s"):
        if step >= 1:
            published[step] = min(published.get(step, t), t)
    return published


def learner_waits(points: list[Point]) -> list[tuple[float, float]]:
    """When the learner waited for data: each step logs its metrics as it commits, after
    waiting `wait_s`, reading `read_s` and updating `update_s` (then `commit_s` on its
    path), so its wait ended that long before the log."""
    steps: dict[tuple[str, int, float], dict[str, float]] = {}
    for writer, name, step, value, t in points:
        stage, _, metric = name.partition("/")
        if stage in LEARNER_STAGES and metric in PROFILE["learn"]:
            steps.setdefault((writer, step, t), {})[metric] = value
    out = []
    for (_, _, t), m in steps.items():
        if len(m) == len(PROFILE["learn"]):
            end = t - m["update_s"] - m["commit_s"] - m["read_s"]
            out.append((end - m["wait_s"], end))
    return out


def rollout_pauses(points: list[Point]) -> list[list[tuple[float, float]]]:
    """Per rollout worker, when it was paused on its backlog: each resume logs `pause_s`."""
    by_writer: dict[str, list[tuple[float, float]]] = {}
    for writer, _, _, value, t in named(points, ("rollout",), "pause_s"):
        by_writer.setdefault(writer, []).append((t - value, t))
    return list(by_writer.values())


CPU_PARTS = {"shardrl": ("total", "generate", "update", "evaluate", "rest"),
             "sync": ("total", "generate", "update", "tables", "score_prepare")}
"""The parts of each side's CPU seconds per step (`cpu_per_step`)."""

PROFILE = {"learn": ("update_s", "commit_s", "read_s", "wait_s"),
           "rollout": ("generate_s", "post_s")}
"""Per-step learner timings and per-shard rollout timings that make the steady-state profile."""


def step_profile(points: list[Point], window: tuple[float, float]) -> dict:
    """Median seconds of each profiled timing inside `window`: a learner step (its update,
    the commit's part on the step's path, reading shards, waiting for data) and a rollout
    shard (its share of the batch's generation, scoring and prepare inline)."""
    out = {}
    for stage, names in PROFILE.items():
        stages = LEARNER_STAGES if stage == "learn" else (stage,)
        for name in names:
            values = [v for _, _, _, v, t in named(points, stages, name)
                      if window[0] <= t <= window[1]]
            out[f"{stage}/{name}"] = percentile(values, 50)
    return out


def steady_busy(points: list[Point], window: tuple[float, float]) -> float | None:
    """Mean over writers of each one's busy share inside `window` (cumulative `busy_s`
    points; see `bench.curves.steady_busy_fraction`)."""
    by_writer: dict[str, list[tuple[float, float]]] = {}
    for writer, _, _, value, t in points:
        by_writer.setdefault(writer, []).append((t, value))
    values = [v for series in by_writer.values()
              if (v := steady_busy_fraction(series, *window)) is not None]
    return sum(values) / len(values) if values else None


def cpu_per_step(cpu_s: dict[str, float] | None, points: list[Point],
                 steps: int) -> dict[str, float] | None:
    """ShardRL's CPU seconds per learner step over its RL phase, in all and by kind of work:
    `total` = the rollout, learn and evaluate processes (`cpu_s`, stage start-up included);
    `generate` = the rollout workers' sampling calls (`sampling_cpu_s`), `update` = the
    learner's updates (`busy_cpu_s`), `evaluate` = the evaluate stage, and `rest` = the
    remainder: scoring and prepare inline, shard encoding and writes, reads, weight
    publishing and loading, commits, metrics, start-up. None without the figures."""
    def newest(stages: tuple[str, ...], name: str) -> float | None:
        """The sum over processes of a cumulative counter's newest value."""
        values = newest_per_writer(named(points, stages, name))
        return sum(values) if values else None

    sampling = newest(("rollout",), "sampling_cpu_s")
    update = newest(LEARNER_STAGES, "busy_cpu_s")
    if not cpu_s or steps <= 0 or sampling is None or update is None:
        return None
    total = sum(cpu_s.get(stage, 0.0) for stage in MACHINE_STAGES)
    evaluate = cpu_s.get("evaluate", 0.0)
    return {"total": total / steps, "generate": sampling / steps, "update": update / steps,
            "evaluate": evaluate / steps,
            "rest": (total - sampling - update - evaluate) / steps}


def training_cpu(parts: dict[str, float] | None) -> float | None:
    """ShardRL's CPU per step but its evaluations' (`cpu_per_step`): the work the peers do on
    their clocks, which pause while they evaluate."""
    if not parts:
        return None
    return parts["total"] - parts.get("evaluate", 0.0)


def metric_points(store, keys) -> list[Point]:
    """Every metric point of a run, from its chunks under `metrics/`."""
    import pyarrow.parquet as pq

    from shardrl.store.keys import metrics_writer

    points: list[Point] = []
    for key in store.list(keys.root + "metrics/"):
        if not key.endswith(".parquet"):
            continue
        t = pq.read_table(io.BytesIO(store.get_bytes(key)),
                          columns=["name", "step", "value", "time"]).to_pydict()
        writer = metrics_writer(key)
        points += [(writer, n, s, v, w) for n, s, v, w in
                   zip(t["name"], t["step"], t["value"], t["time"], strict=True)]
    return points


def run_shardrl(config: str, overrides: list[str], run_id: str) -> dict:
    """Run the pipeline; its curve, RL seconds, sample counts, the figures read from its
    summary and metrics, and the snapshot folder."""
    from shardrl.stages.policy import download_folder
    from shardrl.store import LocalStore, RunKeys

    cmd = [sys.executable, "-m", "shardrl.cli", "run", config, "--store", str(WORK),
           "--run-id", run_id, "--no-progress", "--no-report"]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    store, keys = LocalStore(WORK), RunKeys(run_id)
    run, done = store.get_json(keys.run_json()), store.get_json(keys.done())
    start = run["created"] + run["snapshot_seconds"]
    curve, version_curve, eval_samples = [], [], None
    for key in sorted(k for k in store.list(keys.root + "eval/") if k.endswith(".json")):
        summary = store.get_json(key)
        # the version's publish time, kept in its summary (its weights may be deleted)
        curve.append((max(0.0, summary["published"] - start), summary["pass_at_1"]))
        version_curve.append((float(summary["version"]), summary["pass_at_1"]))
        eval_samples = summary["prompts"] * summary["samples_per_prompt"]
    runner = store.get_json(keys.state("runner", "summary.json"))
    cpu_s, rl_wall_s = runner.get("cpu_s"), runner.get("rl_wall_s")
    window_cpu, window_s = runner.get("rl_cpu_s"), runner.get("rl_window_s")
    share = None
    if window_cpu and window_s:  # sampled at the RL phase's edges
        share = machine_share(window_cpu, MACHINE_STAGES, os.cpu_count() or 1, window_s)
    elif cpu_s and rl_wall_s:
        share = machine_share(cpu_s, MACHINE_STAGES, os.cpu_count() or 1, rl_wall_s)
    snapshot = download_folder(store, keys.policy_prefix(0), WORK / f"{run_id}-snapshot")
    points = metric_points(store, keys)
    return {"curve": sorted(curve), "version_curve": sorted(version_curve),
            "version_times": {v: t - start for v, t in sorted(published_times(points).items())},
            "seconds": done["time"] - start, "steps": done["steps"],
            "samples": runner["accounting"]["generated"],
            "consumed": runner["accounting"]["consumed"], "eval_samples": eval_samples,
            "cpu_s": cpu_s, "rl_wall_s": rl_wall_s, "machine_share": share,
            "cpu_per_step": cpu_per_step(cpu_s, points, done["steps"]),
            "peak_rss_mb": runner.get("peak_rss_mb"),  # read here: the run is discarded after
            **pipeline_figures(points), "snapshot": snapshot}


def discard_run(run_id: str, snapshot: Path) -> None:
    """Remove a finished repeat's store and snapshot folder once every side has read them: a
    20-step SmolLM2 run keeps about 5 GB of checkpoints. A failed repeat raises before this,
    and its store stays for inspection."""
    from shardrl.store import RunKeys

    shutil.rmtree(WORK / RunKeys(run_id).root)
    shutil.rmtree(snapshot)


# -- TRL side ------------------------------------------------------------------------------
TRL_SCALE = {"batch": "batch", "prompt": "group", "none": "none"}
"""Our advantage normalisation -> TRL's `scale_rewards`."""


def trl_loss_args(loss) -> dict:
    """GRPOConfig arguments for our policy loss: CISPO, and PPO's clip without a dual clip (TRL's
    `dapo`: the clipped surrogate, token losses averaged over the batch's tokens, as its
    `cispo` averages them); the other losses have no TRL counterpart here."""
    if loss.kind == "cispo":
        # TRL's cispo clamps the ratio at `epsilon_high` itself (an absolute cap, like max_ratio)
        return {"loss_type": "cispo", "epsilon_high": loss.max_ratio}
    if loss.kind == "ppo" and loss.dual_clip is None:
        # clip range [1 - epsilon, 1 + epsilon_high], as ours is [1 - eps_low, 1 + eps_high]
        return {"loss_type": "dapo", "epsilon": loss.eps_low, "epsilon_high": loss.eps_high}
    raise ValueError(f"loss {loss.kind!r} (as configured) has no TRL mapping here: use "
                     "algo.loss.kind=cispo, or ppo without dual_clip")


def verifier_reward(verify: Callable[[str, str], float]) -> Callable[..., list[float]]:
    """A TRL reward function: 1.0 when `verify(completion, answer)` passes, else 0.0."""

    def task_verifier(completions: list[str], answer: list[str], **_) -> list[float]:
        return [1.0 if verify(c, a) >= 1.0 else 0.0
                for c, a in zip(completions, answer, strict=True)]

    return task_verifier


def make_budget_callback(clock_start: float, budget: float, interval: float,
                         evaluate: Callable):
    """A TrainerCallback whose clock runs from `clock_start` (epoch seconds) less the time
    spent evaluating; it evaluates every `interval` seconds of that clock and stops training
    once `budget` seconds are spent."""
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):
        def __init__(self) -> None:
            self.paused, self.next_eval, self.curve = 0.0, interval, []

        def elapsed(self) -> float:
            return time.time() - clock_start - self.paused

        def measure(self, model) -> float:
            """Held-out pass@1 of `model` now, with the clock paused."""
            t0 = time.time()
            value = evaluate(model)
            model.train()
            self.paused += time.time() - t0
            return value

        def on_step_end(self, args, state, control, model=None, **kwargs):
            at = self.elapsed()
            if at >= budget or at >= self.next_eval:
                self.curve.append((at, self.measure(model)))
                while self.next_eval <= at:
                    self.next_eval += interval
            control.should_training_stop = at >= budget
            return control

    return BudgetCallback()


def run_trl(config: str, overrides: list[str], snapshot: Path, budget: float, eval_points: int,
            clock_start: float | None = None) -> dict:
    """GRPOTrainer from `snapshot` until `budget` seconds of clock (from `clock_start`, by
    default once the libraries are imported, the model loaded and the prompt dataset built;
    evaluations excluded) are spent; its pass@1 curve and sample counts."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from bench.demo_control import heldout_pass
    from bench.sync_baseline import before_clock, load_snapshot
    from shardrl.algo import lr_schedule
    from shardrl.config import load_config
    from shardrl.tasks.prompts import PromptFormat
    from shardrl.tasks.source import make_task

    cfg = load_config(config, overrides)
    before_clock(cfg)
    model, tokenizer = load_snapshot(snapshot)
    torch.set_num_threads(os.cpu_count() or 1)
    task, lc, ro = make_task(cfg), cfg.learner, cfg.rollout
    # the rollout worker's prompt stream, in order: shard `seq` holds train_items(0, seq, n);
    # 32x the prompts ShardRL's learner takes: TRL, faster per step, also sees fresh prompts
    shards = 32 * lc.total_steps * lc.batch_prompts // ro.prompts_per_shard
    items = [it for s in range(shards) for it in task.train_items(0, s, ro.prompts_per_shard)]
    # prompts as ShardRL's rollout formats them (`task.prompt_format`): with `chat` TRL gets
    # the templated text, a plain-text prompt it does not template again
    fmt = PromptFormat.from_config(cfg)
    data = Dataset.from_dict({"prompt": [fmt.text(tokenizer, it.prompt) for it in items],
                              "answer": [it.answer for it in items]})
    # the clock starts once the dataset is built: ShardRL and the baseline draw their prompts
    # as they go (a fraction of a millisecond a shard), and building these 32x as many took
    # TRL's clock about a second, some 20% of its time to the target
    clock_start = time.time() if clock_start is None else clock_start
    callback = make_budget_callback(clock_start, budget, budget / eval_points,
                                    lambda m: heldout_pass(m, tokenizer, cfg, task))
    snapshot_pass = callback.measure(model)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=lc.batch_prompts * ro.group_size,
            gradient_accumulation_steps=1, num_generations=ro.group_size, num_iterations=1,
            max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
            top_k=0, learning_rate=lc.lr, weight_decay=lc.weight_decay, adam_beta1=lc.beta1,
            adam_beta2=lc.beta2, max_grad_norm=lc.grad_clip or 0.0, beta=0.0,
            scale_rewards=TRL_SCALE[cfg.algo.advantages.norm], max_steps=100 * lc.total_steps,
            shuffle_dataset=False, seed=cfg.seed, report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            **trl_loss_args(cfg.algo.loss))
        trainer = GRPOTrainer(model=model, reward_funcs=verifier_reward(task.verify), args=args,
                              train_dataset=data, processing_class=tokenizer,
                              callbacks=[callback])
        # the run config's schedule over its optimizer steps (warmup, then constant or cosine
        # held at its floor from total_steps on), the same multiplier ShardRL's learner uses
        trainer.create_optimizer()
        trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            trainer.optimizer, lambda step: lr_schedule(
                step, warmup_steps=lc.warmup_steps, total_steps=lc.total_steps,
                kind=lc.schedule, min_ratio=lc.min_lr_ratio))
        started = callback.elapsed()
        trainer.train()
    steps = trainer.state.global_step
    return {"curve": [(0.0, snapshot_pass), *callback.curve], "seconds": callback.curve[-1][0],
            "steps": steps, "samples": steps * lc.batch_prompts * ro.group_size,
            "startup_seconds": started, "eval_seconds": callback.paused}


PEERS = {"trl": "bench.trl_bench", "sync": "bench.sync_baseline", "two_process": "bench.two_process"}
"""The module each peer runs in its own process (the same command-line arguments)."""


def peer_process(peer: str, config: str, overrides: list[str], snapshot: Path, budget: float,
                 eval_points: int, extra: list[str] | None = None) -> dict:
    """One peer (`run_trl`, `bench.sync_baseline.run_sync` or `bench.two_process`) in a
    fresh process; its clock starts once its libraries are imported and its model loaded
    (see the module docstring). `extra`: more arguments for the peer's command line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{peer}.json"
        cmd = [sys.executable, "-m", PEERS[peer], "--config", config,
               "--snapshot", str(snapshot), "--budget", str(budget),
               "--eval-points", str(eval_points), "--out", str(out), *(extra or [])]
        for o in overrides:
            cmd += ["--set", o]
        # OpenMP waits as it does in ShardRL's stage processes (see `passive_openmp`)
        env = os.environ | {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"}
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        return json.loads(out.read_text())


def trl_process(config: str, overrides: list[str], snapshot: Path, budget: float,
                eval_points: int) -> dict:
    """`run_trl` in a fresh process."""
    return peer_process("trl", config, overrides, snapshot, budget, eval_points)


# -- driver --------------------------------------------------------------------------------
def one_repeat(config: str, overrides: list[str], tag: str, eval_points: int,
               order: tuple[str, ...] = ("trl", "sync"), sync_threads: Sequence[int] = (1,),
               trl_eval_points: int | None = None, sync_eval_after: bool = False) -> dict:
    """ShardRL's run, then each peer in `order` from its snapshot for as long (the baseline
    once per count of `sync_threads`, in that order); every side and the figures. Without
    "trl" in `order` the row holds the baseline comparison only.

    The baseline's runs go to `sync_runs` (by thread count) and ShardRL's comparison with
    each to `vs_sync_runs`; `choose_baseline` later makes one of them the row's `sync`.
    `eval_points` spread over ShardRL's time for the baseline (evaluated after its budget
    with `sync_eval_after`), `trl_eval_points` (default the same) for TRL."""
    run_id = f"trl-bench-{tag}"
    s = run_shardrl(config, overrides, run_id)
    row: dict = {"shardrl": {k: v for k, v in s.items() if k != "snapshot"}, "sync_runs": {},
                 "order": list(order)}
    for peer in order:
        if peer == "sync":
            for t in sync_threads:
                row["sync_runs"][str(t)] = peer_process(
                    "sync", config, overrides, s["snapshot"], s["seconds"], eval_points,
                    ["--threads", str(t), *(["--eval-after"] if sync_eval_after else [])])
        else:
            row[peer] = peer_process(peer, config, overrides, s["snapshot"], s["seconds"],
                                     trl_eval_points or eval_points)
    sides = [row["shardrl"], *row["sync_runs"].values(), *([row["trl"]] if "trl" in row else [])]
    for r in sides:
        r["final_pass"], r["best_pass"] = r["curve"][-1][1], max(p for _, p in r["curve"])
        r["samples_per_s"] = r["samples"] / r["seconds"]
    row["vs_sync_runs"] = {t: compare_sync(row["shardrl"], run)
                           for t, run in row["sync_runs"].items()}
    discard_run(run_id, s["snapshot"])
    if "trl" in row:
        row["samples_per_s_ratio"] = (row["shardrl"]["samples_per_s"]
                                      / row["trl"]["samples_per_s"])
        row |= compare(s["curve"], row["trl"]["curve"])
    return row


def choose_baseline(rows: list[dict]) -> dict:
    """Make the fastest thread count of the baseline every row's `sync` (and `vs_sync`):
    the count whose runs reach 70% of their own gain soonest on the mean of the repeats'
    gain curves, as a user would tune a loop before comparing anything with it; the other
    counts' runs move to `sync_other_threads` and `vs_sync_other_threads`. Returns, per
    thread count, that pooled time and ShardRL's pooled speedup against it."""
    choice = {}
    for t in rows[0]["sync_runs"]:
        runs = [dict(r, sync=r["sync_runs"][t]) for r in rows]
        by_sync = pooled(runs, "sync")
        choice[t] = {"pooled_seconds": by_sync["sync"],
                     "pooled_speedup": ratio(by_sync["sync"], by_sync["shardrl"])}
    best = min(choice, key=lambda t: (choice[t]["pooled_seconds"] is None,
                                      choice[t]["pooled_seconds"] or 0.0))
    for r in rows:  # the other counts' runs stay beside the chosen one, not twice
        r["sync"], r["vs_sync"] = r["sync_runs"].pop(best), r["vs_sync_runs"].pop(best)
        r["sync_other_threads"] = r.pop("sync_runs")
        r["vs_sync_other_threads"] = r.pop("vs_sync_runs")
    return {"threads": int(best), "by_threads": choice}


def pooled_interval(rows: list[dict], reference: str, draws: int = 500) -> dict | None:
    """90% percentile-bootstrap interval over repeats of the pooled ratio against
    `reference` ("trl": ShardRL's time over TRL's, a None time counted as never, i.e.
    infinitely late; "sync": the baseline's time over ShardRL's): how far the pooled figure
    could move with other seeds. An end that is None is unbounded (in that share of the
    resamples one side's mean curve never got there)."""
    def statistic(idx: list[int]) -> float:
        p = pooled([rows[i] for i in idx], reference)
        other = p[reference]
        mine = p["shardrl"]
        if reference == "trl":
            return math.inf if mine is None else (mine / other if other else math.inf)
        return 0.0 if mine is None else (math.inf if other is None else other / mine)
    interval = bootstrap_interval(statistic, len(rows), draws)
    if interval is None:
        return None
    low, high = (None if math.isinf(v) else v for v in interval)
    return {"low": low, "high": high, "level": 0.9, "draws": draws}


SIDE_FIGURES = ("final_pass", "best_pass", "samples_per_s", "steady_samples_per_s", "seconds",
                "steps")


def summarize(rows: list[dict]) -> dict:
    """Median, min and max over repeats of every figure and of each side's totals, and the
    binomial standard error of each side's median final pass@1. The figures against TRL are
    over the repeats that ran it; the rest over all (`choose_baseline` has set each row's
    `sync`)."""
    trl_rows = [r for r in rows if "trl" in r]

    def over(get: Callable[[dict], float | None], missing: str = "undefined",
             of: list[dict] | None = None) -> dict:
        return spread([get(row) for row in (rows if of is None else of)], missing)

    out: dict = {
        "time_ratio": over(lambda r: r["time_ratio"], "high", trl_rows),
        "pass_gap": over(lambda r: r["pass_gap"], of=trl_rows),
        "samples_per_s_ratio": over(lambda r: r["samples_per_s_ratio"], of=trl_rows),
        "target_time_ratio": over(lambda r: r["target_time_ratio"], "high", trl_rows),
        "target_time_ratio_interpolated":
            over(lambda r: r.get("target_time_ratio_interpolated"), "high", trl_rows),
        "target": over(lambda r: r["target"], of=trl_rows),
        "vs_sync": {
            "time_speedup": over(lambda r: r["vs_sync"]["time_speedup"], "low"),
            "time_speedup_interpolated":
                over(lambda r: r["vs_sync"].get("time_speedup_interpolated"), "low"),
            "samples_per_s_ratio": over(lambda r: r["vs_sync"]["samples_per_s_ratio"]),
            "samples_per_s_ratio_whole_run":
                over(lambda r: r["vs_sync"]["samples_per_s_ratio_whole_run"]),
            "target": over(lambda r: r["vs_sync"]["target"]),
            "cpu_per_step_ratio": over(lambda r: r["vs_sync"].get("cpu_per_step_ratio")),
            "samples_per_step": {
                side: over(lambda r, s=side: r["vs_sync"].get("samples_per_step", {}).get(s))
                for side in ("shardrl", "sync")},
            "early_steps_per_s": {
                side: over(lambda r, s=side: r["vs_sync"].get("early_steps_per_s", {}).get(s))
                for side in ("shardrl", "sync")},
            "early_versions": list(EARLY_VERSIONS),
            "early_steps_per_s_ratio":
                over(lambda r: r["vs_sync"].get("early_steps_per_s_ratio")),
            "versions_to_target": {
                side: over(lambda r, s=side: r["vs_sync"].get("versions_to_target", {}).get(s),
                           "high")
                for side in ("shardrl", "sync")},
            "versions_to_target_ratio":
                over(lambda r: r["vs_sync"].get("versions_to_target_ratio"), "low"),
            **{name: {side: over(lambda r, n=name, s=side: r["vs_sync"].get(n, {}).get(s))
                      for side in ("shardrl", "sync")}
               for name in ("early_update_cpu_ms", "early_rows_per_step")},
        },
        "early_busy_fraction": {
            name: over(lambda r, n=name: r["shardrl"].get("early", {})
                       .get("busy_fraction", {}).get(n))
            for name in BUSY_FIGURES},
        "cpu_per_step": {
            side: {part: over(lambda r, s=side, p=part:
                              (r[s].get("cpu_per_step") or {}).get(p))
                   for part in CPU_PARTS[side]}
            for side in ("shardrl", "sync")},
        "machine_share": over(lambda r: r["shardrl"].get("machine_share")),
        "busy_fraction": {name: over(lambda r, n=name: r["shardrl"]["busy_fraction"][n])
                          for name in ("rollout", "learner")},
        "hop_s": {q: over(lambda r, q=q: r["shardrl"]["hop_s"].get(q))
                  for q in ("p50", "p95", "max")},
        "steady_busy_fraction": {
            name: over(lambda r, n=name: r["shardrl"].get("steady_busy_fraction", {}).get(n))
            for name in BUSY_FIGURES},
        "resume_lag_s": {q: over(lambda r, q=q: r["shardrl"].get("resume_lag_s", {}).get(q))
                         for q in ("p50", "p95")},
        "profile": {name: over(lambda r, n=name: r["shardrl"].get("profile", {}).get(n))
                    for name in (f"{st}/{m}" for st, ms in PROFILE.items() for m in ms)},
        "idle_together": over(lambda r: r["shardrl"].get("idle_together")),
    }
    by_trl, by_sync = pooled(trl_rows, "trl"), pooled(rows, "sync")
    out["pooled"] = {"vs_trl": by_trl, "vs_sync": by_sync,
                     "target_time_ratio": ratio(by_trl["shardrl"], by_trl["trl"]),
                     "target_time_ratio_interval": pooled_interval(trl_rows, "trl"),
                     "sync_time_speedup": ratio(by_sync["sync"], by_sync["shardrl"]),
                     "sync_time_speedup_interval": pooled_interval(rows, "sync")}
    n = rows[0]["shardrl"].get("eval_samples")
    out["eval_samples"] = n
    out["repeats_vs_trl"], out["repeats_vs_sync"] = len(trl_rows), len(rows)
    for side in ("shardrl", "trl", "sync"):
        of = trl_rows if side == "trl" else rows
        out[side] = {k: over(lambda r, s=side, k=k: r[s].get(k), of=of) for k in SIDE_FIGURES}
        median = out[side]["final_pass"]["median"]
        out[side]["final_pass_se"] = None if n is None or median is None else binomial_se(median, n)
    return out


def pooled(rows: list[dict], reference: str) -> dict:
    """Each side's time to 70% of `reference`'s gain on the mean over repeats of the gain
    curves (`curves.pooled_time_to_gain`; each repeat measured against its own reference
    run's snapshot pass@1 and best), for the repeats whose reference gained at all."""
    gains = [(r, (r[reference]["curve"][0][1], max(p for _, p in r[reference]["curve"])))
             for r in rows]
    used = [r for r, (v0, best) in gains if best > v0]
    refs = [(v0, best) for _, (v0, best) in gains if best > v0]
    return {"repeats": len(used)} | {
        side: pooled_time_to_gain([r[side]["curve"] for r in used], refs) if used else None
        for side in ("shardrl", "trl", "sync") if all(side in r for r in rows)}


def _version(package: str) -> str | None:
    """The installed version of `package`, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def fmt(value: float | None, spec: str = ".2f", never: str = "never reached") -> str:
    return never if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repeat r uses the config's seed + r (see --same-seed)")
    parser.add_argument("--same-seed", action="store_true",
                        help="every repeat uses the config's seed (timing noise only)")
    parser.add_argument("--eval-every", type=int, default=10,
                        help="ShardRL evaluates every this many versions; the baseline as "
                             "often in time")
    parser.add_argument("--trl-eval-every", type=int,
                        help="TRL evaluates as often in time as ShardRL makes this many "
                             "versions (default: --eval-every)")
    parser.add_argument("--eval-during", action="store_true",
                        help="ShardRL evaluates beside its training (`eval.when: during`, as "
                             "`make run` does) instead of after it; the peers' clocks pause "
                             "while they evaluate either way")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for every system")
    parser.add_argument("--sync-threads", type=int, nargs="+",
                        help="torch thread counts of the synchronous baseline, each run every "
                             "repeat; the fastest is the comparison's (default: 1 and one per "
                             "core)")
    parser.add_argument("--sync-repeats", type=int, default=0,
                        help="more repeats after --repeats with ShardRL and the baseline only "
                             "(no TRL): the baseline comparison is noisier than its timings")
    trl_only = parser.add_argument_group("TRL side only (what the benchmark runs in a process)")
    trl_only.add_argument("--snapshot", type=Path, help="HF folder to start TRL from")
    trl_only.add_argument("--budget", type=float, help="seconds of TRL clock")
    trl_only.add_argument("--eval-points", type=int, default=6)
    trl_only.add_argument("--clock-start", type=float,
                          help="epoch seconds (default: once the libraries are imported, "
                               "the model loaded and the prompt dataset built)")
    trl_only.add_argument("--out", type=Path, help="JSON written here")
    args = parser.parse_args()
    if args.snapshot is not None:
        if args.budget is None or args.out is None:
            parser.error("--snapshot needs --budget and --out")
        from bench.sync_baseline import passive_openmp

        passive_openmp()
        result = run_trl(args.config, args.overrides, args.snapshot, args.budget,
                         args.eval_points, args.clock_start)
        args.out.write_text(json.dumps(result))
        return

    from bench.results import merge_results
    from shardrl.config import load_config

    overrides = ["tracking.enabled=false", f"eval.every={args.eval_every}",
                 f"eval.when={'during' if args.eval_during else 'after'}", *args.overrides]
    cfg = load_config(args.config, overrides)
    steps = cfg.learner.total_steps
    eval_points = max(1, steps // args.eval_every)
    trl_every = args.trl_eval_every or args.eval_every
    trl_eval_points = max(1, steps // trl_every)
    total = args.repeats + args.sync_repeats
    seeds = [cfg.seed + (0 if args.same_seed else r) for r in range(total)]
    threads = sorted(set(args.sync_threads or (1, os.cpu_count() or 1)))
    rows = []
    for r, seed in enumerate(seeds):  # the peers' order alternates: drifting load hits both
        order = ("trl", "sync") if r % 2 == 0 else ("sync", "trl")
        if r >= args.repeats:
            order = ("sync",)
        rows.append(one_repeat(args.config, [*overrides, f"seed={seed}"],
                               f"{int(time.time())}-{r}", eval_points, order,
                               threads if r % 2 == 0 else threads[::-1], trl_eval_points,
                               sync_eval_after=not args.eval_during) | {"seed": seed})
        print(json.dumps(rows[-1]), flush=True)
    choice = choose_baseline(rows)
    summary = {"config": args.config, "overrides": overrides, "repeats": args.repeats,
               "sync_repeats": args.sync_repeats, "seeds": seeds,
               "eval_every": args.eval_every,
               "trl_eval_every": trl_every,
               "trl_version": _version("trl") if args.repeats else None,
               "sync_threads": choice["threads"], "sync_choice": choice["by_threads"],
               "rows": rows} | summarize(rows)
    vs = summary["vs_sync"]
    trl = (f"time to 70% of TRL's gain, ShardRL / TRL: "
           f"{fmt(summary['target_time_ratio']['median'])} (target <= 1.0, aim 0.5) | "
           f"samples/s ShardRL / TRL: {fmt(summary['samples_per_s_ratio']['median'])} "
           f"(target >= 1.0, aim 1.5) | ") if args.repeats else ""
    print(f"{trl}time to 70% of sync's gain, sync / ShardRL: "
          f"{fmt(vs['time_speedup']['median'], never='ShardRL never reached it')} "
          f"(target >= 1.25; pooled {fmt(summary['pooled'].get('sync_time_speedup'))}) | "
          f"steady samples/s ShardRL / sync: "
          f"{fmt(vs['samples_per_s_ratio']['median'], never='not measured')} | "
          f"machine share {fmt(summary['machine_share']['median'], never='not recorded')} "
          f"(target >= 0.8)")
    # without TRL repeats the run is the baseline comparison alone: kept apart from the
    # figures of a whole run, and another config's apart from the demo's
    key, config = "trl" if args.repeats else "trl_sync_only", Path(args.config).stem
    merge_results(key if config == "demo" else f"{key}_{config}", summary)


if __name__ == "__main__":
    main()
