"""Asynchrony: the same config and number of learner steps with k=0 (synchronous) and k=8.

Reports, per mode, the RL phase's wall clock (snapshot excluded), the learner's busy
fraction (share of wall time spent computing updates rather than waiting for data) and the
samples generated; medians over repeats, both modes measured side by side in one run.

    .venv/bin/python -m bench.async_bench --steps 30 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from bench.results import merge_results
from shardrl.store import LocalStore, RunKeys

WORK = Path(__file__).parent / "_work" / "async"


def busy_fraction(store_dir: Path, run_id: str) -> float:
    last = (-1, 0.0)
    for f in (store_dir / "runs" / run_id / "metrics" / "learn").glob("*.parquet"):
        t = pq.read_table(f)
        for name, step, value in zip(t.column("name").to_pylist(), t.column("step").to_pylist(),
                                     t.column("value").to_pylist(), strict=True):
            if name == "learn/busy_fraction" and step >= last[0]:
                last = (step, value)
    return last[1]


def one(k: int, steps: int, config: str, tag: str) -> dict:
    run_id = f"async-k{k}-{tag}"
    cmd = [sys.executable, "-m", "shardrl.cli", "run", config, "--store", str(WORK),
           "--run-id", run_id, "--no-progress", "--set", f"learner.max_staleness={k}",
           "--set", f"learner.total_steps={steps}", "--set", f"eval.every={steps}",
           "--set", "tracking.enabled=false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    store, keys = LocalStore(WORK), RunKeys(run_id)
    run, done = store.get_json(keys.run_json()), store.get_json(keys.done())
    generated = sum(1 for _ in store.list(keys.kind_prefix("rollouts")))
    return {"k": k, "rl_seconds": done["time"] - run["created"] - run["snapshot_seconds"],
            "busy_fraction": busy_fraction(WORK, run_id), "rollout_shards": generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default="demo")
    args = parser.parse_args()
    rows: dict[int, list[dict]] = {0: [], 8: []}
    for r in range(args.repeats):
        for k in (0, 8):  # interleaved, so drifting machine load hits both modes alike
            rows[k].append(one(k, args.steps, args.config, f"{int(time.time())}-{r}"))
            print(rows[k][-1], flush=True)
    summary = {}
    for k, rs in rows.items():
        secs = [r["rl_seconds"] for r in rs]
        summary[f"k{k}"] = {"rl_seconds_median": statistics.median(secs), "min": min(secs),
                            "max": max(secs),
                            "busy_fraction_median": statistics.median(r["busy_fraction"] for r in rs),
                            "runs": rs}
    summary["speedup_async_over_sync"] = (summary["k0"]["rl_seconds_median"]
                                          / summary["k8"]["rl_seconds_median"])
    summary["steps"] = args.steps
    print(f"k=0 {summary['k0']['rl_seconds_median']:.1f}s busy "
          f"{summary['k0']['busy_fraction_median']:.2f} | k=8 "
          f"{summary['k8']['rl_seconds_median']:.1f}s busy {summary['k8']['busy_fraction_median']:.2f}"
          f" | speedup {summary['speedup_async_over_sync']:.2f}x")
    merge_results("async", summary)


if __name__ == "__main__":
    main()
