"""Asynchrony: what bounded staleness buys, on separate cores and on one shared machine.

Every variant runs the same config (`bench/configs/overlap.yaml`: a 3.4M-parameter model,
no SFT, every group trained) for the same number of learner steps through `shardrl run`.
The figure of a run is its steady-state step time: the learner's wall clock from its third
step to its last, divided by the steps in between (process start-up and the first steps'
imports are left out alike for every variant). Variants run interleaved, `--repeats` times.

* Disaggregated: the generator (rollout) and the learner pinned to one core each with one
  thread, as they would sit on separate GPUs or pods; `k=0` (synchronous) against `k=8`.
  The ideal speedup is `(g + l) / max(g, l)`, with g the generation time and l the update
  time of one step, both measured in those same pinned runs.
* Shared machine: the best synchronous configuration (`k=0`, each phase on every core)
  against `k=8` with a fixed split (one thread each) and `k=8` with core sharing (a busy
  stage borrows the cores idle stages leave, `pipeline.local.share_cores`). (No bound on
  this speedup is derived: the single-threaded g and l above do not say what the same work
  costs on all threads, so `sync step / ((g + l) / cores)` would not be one.)
* The learner's busy fraction: update time over wall clock, steady state and whole run.

    .venv/bin/python -m bench.async_bench --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from bench.results import merge_results

WORK = Path(__file__).parent / "_work" / "async"
CONFIG = Path(__file__).parent / "configs" / "overlap.yaml"
SKIP = 2
"""Leading learner steps left out of the steady state."""

VARIANTS: dict[str, list[str]] = {
    "pinned_k0": ["learner.max_staleness=0", "pipeline.local.cores={rollout: [0], learn: [1]}"],
    "pinned_k8": ["learner.max_staleness=8", "pipeline.local.cores={rollout: [0], learn: [1]}"],
    "shared_k0_all_threads": ["learner.max_staleness=0", "pipeline.local.share_cores=false",
                              "rollout.threads={cores}", "learner.threads={cores}"],
    "shared_k8_fixed_split": ["learner.max_staleness=8", "pipeline.local.share_cores=false"],
    "shared_k8_sharing": ["learner.max_staleness=8", "pipeline.local.share_cores=true"],
}


def stage_metric(run_dir: Path, stage: str, name: str) -> list[tuple[int, float, float]]:
    """(step, value, unix time) of one metric of one stage, in time order."""
    rows = []
    for chunk in (run_dir / "metrics" / stage).rglob("*.parquet"):
        t = pq.read_table(chunk).to_pydict()
        rows += [(s, v, w) for n, s, v, w in zip(t["name"], t["step"], t["value"], t["time"],
                                                  strict=True) if n == f"{stage}/{name}"]
    return sorted(rows, key=lambda r: r[2])


def measure(run_dir: Path, shards_per_step: int) -> dict:
    """Steady-state figures of one finished run (see the module docstring)."""
    updates = stage_metric(run_dir, "learn", "update_s")
    steady = updates[SKIP:]
    span = steady[-1][2] - steady[0][2]
    steps = len(steady) - 1
    gen = [v for _, v, _ in stage_metric(run_dir, "rollout", "generate_s")]
    busy = stage_metric(run_dir, "learn", "busy_fraction")
    return {
        "step_s": span / steps,
        "g_s": statistics.median(gen) * shards_per_step,
        "l_s": statistics.median(v for _, v, _ in steady),
        "busy_steady": sum(v for _, v, _ in steady[1:]) / span,
        "busy_whole_run": busy[-1][1],
    }


def one(variant: str, cores: int, tag: str) -> dict:
    run_id = f"{variant}-{tag}"
    sets = [s.replace("{cores}", str(cores)) for s in VARIANTS[variant]]
    cmd = [sys.executable, "-m", "shardrl.cli", "run", str(CONFIG), "--store", str(WORK),
           "--run-id", run_id, "--no-progress", "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    from shardrl.config import load_config
    from shardrl.stages.staleness import shards_per_step

    cfg = load_config(str(CONFIG), sets)
    per_step = shards_per_step(cfg.learner.batch_prompts, cfg.rollout.prompts_per_shard,
                               cfg.rollout.workers)
    return {"variant": variant, **measure(WORK / "runs" / run_id, per_step)}


def summarize(rows: dict[str, list[dict]], cores: int) -> dict:
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "variant"}
           for v, rs in rows.items()}
    out: dict = {"variants": {v: med[v] | {"step_s_min": min(r["step_s"] for r in rs),
                                           "step_s_max": max(r["step_s"] for r in rs)}
                              for v, rs in rows.items()}}
    p0, p8 = med["pinned_k0"], med["pinned_k8"]
    g, u = p0["g_s"], p0["l_s"]  # generation and update time of one step
    ideal = (g + u) / max(g, u)
    achieved = p0["step_s"] / p8["step_s"]
    out["disaggregated"] = {"g_s": g, "l_s": u, "ideal": ideal, "speedup": achieved,
                            "fraction_of_ideal": achieved / ideal}
    sync = med["shared_k0_all_threads"]["step_s"]
    out["shared"] = {
        "sync_all_threads_step_s": sync,
        "speedup_fixed_split": sync / med["shared_k8_fixed_split"]["step_s"],
        "speedup_sharing": sync / med["shared_k8_sharing"]["step_s"],
    }
    out["busy_fraction"] = {v: {"steady": med[v]["busy_steady"],
                                "whole_run": med[v]["busy_whole_run"]} for v in med}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.repeats):
        for variant in args.variants:  # interleaved: drifting load hits every variant alike
            rows[variant].append(one(variant, cores, f"{int(time.time())}-{r}"))
            print(rows[variant][-1], flush=True)
    if set(args.variants) != set(VARIANTS):
        return
    summary = summarize(rows, cores) | {"repeats": args.repeats, "cores": cores,
                                        "config": str(CONFIG.relative_to(CONFIG.parents[2]))}
    d, s = summary["disaggregated"], summary["shared"]
    print(f"disaggregated: g {d['g_s']:.2f}s l {d['l_s']:.2f}s ideal {d['ideal']:.2f}x "
          f"achieved {d['speedup']:.2f}x ({d['fraction_of_ideal']:.2f} of ideal)")
    print(f"shared: sync {s['sync_all_threads_step_s']:.2f}s/step; k=8 fixed split "
          f"{s['speedup_fixed_split']:.2f}x, sharing {s['speedup_sharing']:.2f}x")
    merge_results("async", summary)


if __name__ == "__main__":
    main()
