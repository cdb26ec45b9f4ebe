"""`make bench`: every benchmark, then bench/RESULTS.md from bench/results.json."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.results import RESULTS

BENCHES = [
    ["bench.algo_bench"],
    ["bench.store_bench"],
    ["bench.async_bench", "--steps", "30", "--repeats", "2"],
]


def table() -> str:
    r = json.loads(RESULTS.read_text())
    lines = ["# Benchmark results", "", f"machine: {json.dumps(next((v['machine'] for v in r.values() if 'machine' in v), {}))}",
             "", "| benchmark | figure | value |", "|---|---|---|"]
    if "algo" in r:
        for name, case in r["algo"]["cases"].items():
            lines.append(f"| algo | {name}: library / inline time (target <= 1.05) | "
                         f"{case['ratio']:.2f} |")
    if "store" in r:
        for name, b in r["store"].get("backends", {}).items():
            lines.append(f"| store | {name}: shard / raw throughput (target >= 0.5) | "
                         f"{b['ratio']:.2f} |")
    if "async" in r:
        a = r["async"]
        lines.append(f"| async | RL wall k=0 / k=8 (median) | {a['speedup_async_over_sync']:.2f}x |")
        lines.append(f"| async | learner busy fraction k=0 | {a['k0']['busy_fraction_median']:.2f} |")
        lines.append(f"| async | learner busy fraction k=8 | {a['k8']['busy_fraction_median']:.2f} |")
    if "demo_control" in r:
        for row in r["demo_control"]["rows"]:
            lines.append(f"| demo seed {row['seed']} | pass@1 SFT -> RL (SFT continued) | "
                         f"{row['sft_plateau']:.3f} -> {row['rl_final']:.3f} "
                         f"({row['sft_continued']:.3f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    for bench in BENCHES:
        subprocess.run([sys.executable, "-m", *bench], check=True)
    text = table()
    (RESULTS.parent / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
