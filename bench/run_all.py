"""`make bench`: every benchmark, then bench/RESULTS.md from bench/results.json.

Each benchmark merges its figures under its own key; the table below reads them back, so a
benchmark run on its own (`python -m bench.NAME`) updates its rows the next time the table
is written (`python -m bench.run_all --table-only`).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from bench.results import RESULTS

BENCHES = [
    ["bench.algo_bench"],
    ["bench.store_bench"],
    ["bench.async_bench", "--repeats", "2"],
    # 240 steps: ShardRL's RL phase (~20 s) is the budget of TRL and the synchronous baseline,
    # long enough for TRL to reach its plateau; the baseline runs on one thread and on all
    # cores, and the faster one is the comparison's (one thread won on some hosts here, two
    # on others). ShardRL evaluates every 2 versions (about 0.13 s of its clock) and the
    # baseline as often in time, both after their training: the baseline's 70% target falls
    # 0.7-1.5 s in, and with points 10 versions apart (0.6-0.9 s) most seeds crossed it at
    # the first or second point on both sides, so the time to it was mostly the time to that
    # point. TRL reaches its target later (about 5 s) and evaluates between its steps: it
    # keeps points 10 versions' worth apart. Five seeds with TRL and fifteen more without: the
    # time to a target varies a lot from seed to seed (one policy dips below it for a few
    # versions, another does not), more than the timings do; with ten seeds the pooled
    # speedup over the baseline read 1.12x in one run and 1.45x in the next, its interval
    # about 0.6 wide. A repeat without TRL takes about a third of the time
    ["bench.trl_bench", "--repeats", "5", "--sync-repeats", "15", "--eval-every", "2",
     "--trl-eval-every", "10", "--set", "learner.total_steps=240"],
    # five repeats: a large-model repeat is 10 steps, and three of them read 0.85-0.94 of the
    # bare loop on one host where five read 0.95 (0.90-1.10)
    ["bench.overhead_bench", "--repeats", "5"],
    ["bench.growth_bench"],
    ["bench.publish_bench"],
    # about 45 s a seed on 2 cores (snapshot, a 60-step RL phase of ~10 s, the SFT control for
    # as long, evaluations); `--total-steps` shortens the RL phase should that grow
    ["bench.demo_control", "--seeds", "0", "1", "2"],
]

Row = tuple[str, str, str, str]
"""(benchmark, figure, target, value)"""


def _algo(r: dict) -> Iterator[Row]:
    for name, case in r["cases"].items():
        label = f"{name}: library / inline time, best of {r['repeats']} (ratio of medians)"
        medians = case.get("median_ratio", float("nan"))
        yield "algo", label, "<= 1.05", f"{case['ratio']:.2f} ({medians:.2f})"


def _store(r: dict) -> Iterator[Row]:
    table_mb = r.get("table_bytes", 0) / 1e6
    for name, b in r.get("backends", {}).items():
        # no target on this one: random bytes of the table's in-memory size are more bytes
        # than the shard file, and an fsync'd put grows faster than its size here
        yield ("store", f"{name}: shard write+read / raw put+get of the table's in-memory "
               f"bytes ({table_mb:.1f} MB; the shard file is smaller)", "",
               f"{b['ratio']:.2f}")
        equal = b.get("ratio_equal_bytes", b.get("ratio_vs_file_bytes"))
        if equal is not None:
            yield ("store", f"{name}: shard write+read / raw put+get of the shard file's bytes "
                   f"({b['shard_bytes'] / 1e6:.1f} MB, equal bytes)", ">= 0.5", f"{equal:.2f}")


def _async(r: dict) -> Iterator[Row]:
    if "disaggregated" not in r:  # written by an older version of the benchmark
        return
    d, s, busy = r["disaggregated"], r["shared"], r["busy_fraction"]
    yield ("async", f"disaggregated k=0 / k=8 step time (g {d['g_s']:.2f} s, l {d['l_s']:.2f} s,"
           f" ideal {d['ideal']:.2f}x)", "", f"{d['speedup']:.2f}x")
    yield "async", "disaggregated: achieved / ideal", ">= 0.9", f"{d['fraction_of_ideal']:.2f}"
    yield ("async", "shared machine: k=8 with core sharing vs best sync (all threads)", ">= 1.1x",
           f"{s['speedup_sharing']:.2f}x")
    if "speedup_fixed_split" in s:
        yield ("async", "shared machine: k=8, fixed 1+1 threads vs best sync", "",
               f"{s['speedup_fixed_split']:.2f}x")
    for variant, value in busy.items():
        yield ("async", f"learner busy fraction, {variant} (steady / whole run)",
               ">= 0.85 (k=8)" if "k8" in variant else "",
               f"{value['steady']:.2f} / {value['whole_run']:.2f}")


def _num(value: float | None, spec: str = ".2f", none: str = "not measured",
         suffix: str = "") -> str:
    return none if value is None else format(value, spec) + suffix


def _spread(d: dict | None, spec: str = ".2f", none: str = "not measured",
            suffix: str = "") -> str:
    """`median (min to max)` of a figure over repeats; `none` where a value is undefined (a
    never-reached target sorts as the worst value)."""
    if d is None or (d["median"] is None and d["min"] is None and d["max"] is None):
        return none
    text = _num(d["median"], spec, none, suffix)
    if d["min"] != d["max"]:
        text += (f" ({_num(d['min'], spec, none, suffix)} to "
                 f"{_num(d['max'], spec, none, suffix)})")
    if d.get("undefined"):
        text += f", {d['undefined']} {none}"
    return text


SIDES = {"shardrl": "ShardRL", "trl": "TRL", "sync": "sync"}


def _pass(side: dict, n: int | None) -> str:
    """Median final pass@1 over repeats ± the binomial standard error of one evaluation at
    that rate; at 0 or 1 (where that error is 0) the count instead."""
    from bench.curves import binomial_se

    p = side["final_pass"]["median"]
    if not n:
        return f"{p:.3f}"
    if p in (0.0, 1.0):
        return f"{p:.3f} ({round(p * n)}/{n})"
    return f"{p:.3f} ± {binomial_se(p, n):.3f}"


def _interval(interval: dict | None, suffix: str = "") -> str:
    """" (low to high)" of a bootstrap interval, or nothing."""
    if not interval:
        return ""
    low, high = (_num(interval[end], suffix=suffix, none="unbounded")
                 for end in ("low", "high"))
    return f" ({low} to {high})"


def _interval_note(pooled: dict, name: str) -> str:
    """Says what the bracket after a pooled figure is, when there is one."""
    interval = pooled.get(f"{name}_interval")
    return (f"; in brackets its {interval['level']:.0%} bootstrap interval over repeats"
            if interval else "")


def _trl(r: dict) -> Iterator[Row]:
    repeats, seeds = r.get("repeats", 1), r.get("seeds")
    over = f"median (min to max) of {repeats}" if repeats > 1 else "1 repeat"
    if seeds is not None and repeats > 1:
        over += (f", seed {seeds[0]} each time" if len(set(seeds)) == 1
                 else f", seeds {', '.join(map(str, seeds[:repeats]))}")
    grids = ""
    if "eval_every" in r and "trl_eval_every" in r:
        grids = (f"; ShardRL evaluated every {r['eval_every']} versions, TRL every "
                 f"{r['trl_eval_every']} steps: a first measured time is up to one interval "
                 "late, which favours the denser grid")
    if "target_time_ratio" in r:
        yield ("trl", f"time to 70% of TRL's pass@1 gain over the snapshot, ShardRL / TRL "
               f"({over}{grids})", "<= 1.0 (aim 0.5)",
               _spread(r["target_time_ratio"], none="never reached"))
    if "target_time_ratio_interpolated" in r:
        yield ("trl", "the same, each crossing read between its evaluations (linear)",
               "<= 1.0 (aim 0.5)", _spread(r["target_time_ratio_interpolated"],
                                           none="never reached"))
    if "pooled" in r:
        p = r["pooled"]["vs_trl"]
        yield ("trl", f"the same on the mean of the {p['repeats']} repeats' gain curves (each "
               f"repeat's share of its TRL run's gain): ShardRL {_num(p['shardrl'], suffix=' s')}"
               f", TRL {_num(p['trl'], suffix=' s')}{_interval_note(r['pooled'], 'target_time_ratio')}",
               "<= 1.0 (aim 0.5)",
               _num(r["pooled"]["target_time_ratio"], none="never reached")
               + _interval(r["pooled"].get("target_time_ratio_interval")))
    yield ("trl", "ShardRL time to TRL's final pass@1 / TRL wall clock", "<= 0.5",
           _spread(r["time_ratio"], none="never reached"))
    yield ("trl", "pass@1 ShardRL - TRL at TRL's final time", ">= 0",
           _spread(r["pass_gap"], "+.3f"))
    n = r.get("eval_samples")
    sides = [s for s in SIDES if s in r]
    names = " / ".join(SIDES[s] for s in sides)
    se = f"; ± binomial SE of one evaluation of n = {n} held-out samples" if n else ""
    counts = (f"; medians over {r.get('repeats_vs_sync', repeats)} repeats, TRL's over "
              f"{repeats}" if "sync" in sides and r.get("repeats_vs_sync", repeats) != repeats
              else "")
    yield ("trl", f"final pass@1 {names} (median; equal wall clock{se}{counts})", "",
           " / ".join(_pass(r[s], n) for s in sides))
    yield ("trl", "generated samples/s ShardRL / TRL (filtered groups included: ShardRL "
           "generates more per step; whole runs, start-up included)", ">= 1.0 (aim 1.5)",
           _spread(r["samples_per_s_ratio"]))
    yield ("trl", f"generated samples/s {names} (median, whole runs{counts})", "",
           " / ".join(f"{r[s]['samples_per_s']['median']:.1f}" for s in sides))
    if "vs_sync" in r:
        vs = r["vs_sync"]
        n_sync = r.get("repeats_vs_sync", repeats)
        every = r.get("eval_every")
        grid = (f"; ShardRL evaluated every {every} versions, the baseline as often in time"
                if every else "")
        yield ("trl/sync", "time to 70% of the sync baseline's pass@1 gain, sync / ShardRL "
               f"(median (min to max) of {n_sync} repeats"
               + (f", seeds {seeds[0]}-{seeds[-1]}" if seeds and len(set(seeds)) > 1 else "")
               + f"{grid})",
               ">= 1.25x", _spread(vs["time_speedup"], none="ShardRL never reached",
                                   suffix="x"))
        if "time_speedup_interpolated" in vs:
            yield ("trl/sync", "the same, each crossing read between its evaluations (linear)",
                   ">= 1.25x", _spread(vs["time_speedup_interpolated"],
                                       none="ShardRL never reached", suffix="x"))
        if "pooled" in r:
            p = r["pooled"]["vs_sync"]
            yield ("trl/sync", f"the same on the mean of the {p['repeats']} repeats' gain curves"
                   f" (each repeat's share of its sync run's gain): sync "
                   f"{_num(p['sync'], suffix=' s')}, ShardRL {_num(p['shardrl'], suffix=' s')}"
                   f"{_interval_note(r['pooled'], 'sync_time_speedup')}",
                   ">= 1.25x", _num(r["pooled"]["sync_time_speedup"],
                                    none="ShardRL never reached", suffix="x")
                   + _interval(r["pooled"].get("sync_time_speedup_interval"), "x"))
        if "sync_choice" in r:
            choice = r["sync_choice"]
            yield ("trl/sync", "the baseline's torch threads, chosen as the fastest: its pooled "
                   "time to its own target (s) / ShardRL's pooled speedup against it, per "
                   "thread count", "",
                   "; ".join(f"{t} thread{'s' if t != '1' else ''}: "
                             f"{_num(c['pooled_seconds'], suffix=' s')} / "
                             f"{_num(c['pooled_speedup'], suffix='x')}"
                             + (" (chosen)" if int(t) == r["sync_threads"] else "")
                             for t, c in sorted(choice.items(), key=lambda kv: int(kv[0]))))
        if "early_steps_per_s_ratio" in vs:
            lo, hi = vs["early_versions"]
            per = vs["early_steps_per_s"]
            yield ("trl/sync", f"the speedup taken apart (1): optimizer steps/s from version {lo} "
                   f"to {hi}, ShardRL / sync (medians: {_num(per['shardrl']['median'], '.1f')} / "
                   f"{_num(per['sync']['median'], '.1f')})", "",
                   _spread(vs["early_steps_per_s_ratio"], suffix="x"))
            per = vs["versions_to_target"]
            yield ("trl/sync", "the speedup taken apart (2): versions to the same target, sync / "
                   f"ShardRL, each read between its evaluations (medians: "
                   f"{_num(per['sync']['median'], '.1f')} / {_num(per['shardrl']['median'], '.1f')}; "
                   "below 1: a ShardRL step learned less)", "",
                   _spread(vs["versions_to_target_ratio"], none="ShardRL never reached",
                           suffix="x"))
            if "early_update_cpu_ms" in vs:
                yield from _early(r, vs, lo, hi)
        yield ("trl/sync", "steady-state samples/s ShardRL / sync (first to last new version)",
               "", _spread(vs["samples_per_s_ratio"], suffix="x"))
        yield ("trl/sync", "samples/s ShardRL / sync (whole runs, start-up included)", "",
               _spread(vs["samples_per_s_ratio_whole_run"], suffix="x"))
        if "cpu_per_step_ratio" in vs and "cpu_per_step" in r:
            yield from _cpu_per_step(r["cpu_per_step"], vs)
    if "machine_share" in r:
        yield ("trl", "ShardRL machine share: stage CPU seconds over the RL phase / "
               "(cores x its wall clock)",
               ">= 0.8", _spread(r["machine_share"], none="not recorded"))
        busy = r["busy_fraction"]
        steady = r.get("steady_busy_fraction", {})
        if steady:
            yield ("trl", "ShardRL rollout busy fraction, steady state (mean over workers): "
                   "time not paused on the backlog", ">= 0.85",
                   _spread(steady["rollout"], none="not recorded"))
            if "rollout_generating" in steady:
                yield ("trl", "ShardRL rollout steady state: share of the time inside "
                       "generation batches (sampling, inline scoring and prepare, shard "
                       "hand-off; not weight loads or drawing and encoding prompts)", "",
                       _spread(steady["rollout_generating"], none="not recorded"))
            yield ("trl", "ShardRL learner busy fraction, steady state: wall / CPU seconds "
                   "of updates (CPU: without contention inflation)", "",
                   " / ".join(_spread(steady[n], none="not recorded")
                              for n in ("learner", "learner_cpu")))
        if "idle_together" in r:
            yield ("trl", "ShardRL steady state: share of the time the learner waits for data "
                   "while every rollout worker is paused on its backlog (a hand-off bubble)",
                   "", _spread(r["idle_together"], ".3f", none="not recorded"))
        yield ("trl", "ShardRL rollout busy fraction (whole run, start-up included)", "",
               _spread(busy["rollout"], none="not recorded"))
        yield ("trl", "ShardRL learner busy fraction (whole run, start-up included)", "",
               _spread(busy["learner"], none="not recorded"))
        if "profile" in r:
            prof = r["profile"]
            ms = {k: (v["median"] * 1000 if v and v["median"] is not None else None)
                  for k, v in prof.items()}

            def f(k: str) -> str:
                return "n/a" if ms.get(k) is None else f"{ms[k]:.1f}"
            yield ("trl", "profile, steady state (median ms): learner step = update / commit "
                   "on the step's path / reading shards / waiting for data", "",
                   " / ".join(f(f"learn/{n}") for n in ("update_s", "commit_s", "read_s",
                                                          "wait_s")))
            yield ("trl", "profile, steady state (median ms): rollout shard = its share of "
                   "generation / scoring and prepare inline (writes run on a background thread)",
                   "", " / ".join(f(f"rollout/{n}") for n in ("generate_s", "post_s")))
        if "resume_lag_s" in r:
            yield ("trl", "ShardRL hop, learner commit -> paused worker resumes (s): p50 / p95",
                   "", " / ".join(_spread(r["resume_lag_s"][q], ".3f", "not recorded")
                                  for q in ("p50", "p95")))
        hop = r["hop_s"]
        yield ("trl", "ShardRL hop, shard generated -> read by the learner (s): p50 / p95 of "
               "the per-step medians / max", "",
               " / ".join(_spread(hop.get(q), ".2f", "not recorded")
                          for q in ("p50", "p95", "max")))


def _early(r: dict, vs: dict, lo: int, hi: int) -> Iterator[Row]:
    """Where the targets are crossed: each side's milliseconds per step, its update's CPU
    and kept rows, and ShardRL's busy fractions there (medians)."""
    def med(figure: dict, side: str, spec: str = ".0f") -> str:
        return _num(figure[side]["median"], spec)

    per, cpu, rows = vs["early_steps_per_s"], vs["early_update_cpu_ms"], vs["early_rows_per_step"]
    step_ms = {s: (None if per[s]["median"] is None else 1000.0 / per[s]["median"])
               for s in ("shardrl", "sync")}
    yield ("trl/sync", f"the speedup taken apart (3), versions {lo} to {hi} (medians): ms per "
           "step / CPU ms of its update / kept rows it trains on, ShardRL; sync", "",
           f"{_num(step_ms['shardrl'], '.0f')} / {med(cpu, 'shardrl')} / "
           f"{med(rows, 'shardrl')}; {_num(step_ms['sync'], '.0f')} / {med(cpu, 'sync')} / "
           f"{med(rows, 'sync')}")
    busy = r.get("early_busy_fraction", {})
    if busy:
        yield ("trl/sync", f"ShardRL, versions {lo} to {hi}: rollout busy / generating (mean "
               "over workers) / learner busy, wall / learner updates, CPU (medians; a learner "
               "near 1 with idle workers: its update sets the step rate)", "",
               " / ".join(_num(busy[n]["median"]) for n in
                          ("rollout", "rollout_generating", "learner", "learner_cpu")))


def _cpu_per_step(cpu: dict, vs: dict) -> Iterator[Row]:
    """CPU milliseconds per optimizer step of each side, by kind of work (medians)."""
    def ms(side: str, part: str) -> str:
        value = cpu[side].get(part, {}).get("median")  # a part older results lack
        return "n/a" if value is None else f"{value * 1000:.0f}"

    per = vs["samples_per_step"]
    samples = " / ".join("n/a" if per[s]["median"] is None else f"{per[s]['median']:.0f}"
                         for s in ("shardrl", "sync"))
    yield ("trl/sync", "CPU ms per optimizer step, ShardRL (whole RL phase, median): all / "
           "sampling calls / updates / evaluate / the rest (scoring and prepare, shard "
           "encoding, writes and reads, weight publishing and loading, commits, metrics, "
           "start-up)", "", " / ".join(ms("shardrl", p) for p in
                                      ("total", "generate", "update", "evaluate", "rest")))
    yield ("trl/sync", "CPU ms per optimizer step, sync baseline: all / sampling calls / "
           "updates / drawing prompts and building tables / scoring and prepare", "",
           " / ".join(ms("sync", p) for p in ("total", "generate", "update", "tables",
                                               "score_prepare")))
    yield ("trl/sync", f"CPU per step ShardRL (all but evaluate) / sync (samples generated per "
           f"step: {samples})",
           "", _spread(vs["cpu_per_step_ratio"], suffix="x"))


def _overhead(r: dict) -> Iterator[Row]:
    for size in ("demo", "large"):
        m = r[size]["model"]
        shape = f"{size} model (hidden {m['hidden_size']}, {m['num_layers']} layers)"
        for stage, bare in (("learn", "bare torch loop"), ("rollout", "bare generate")):
            d = r[size][stage]
            steady = f", steady {d['ratio_steady']['median']:.2f}" if "ratio_steady" in d else ""
            engine = "ratio_engine" in d  # then the engine alone is the overhead's baseline
            yield ("overhead", f"{shape}: {stage} stage tokens/s / {bare}"
                   + (" (`model.generate`: another sampling loop)" if engine else ""),
                   "" if engine else ">= 0.90",
                   f"{d['ratio']['median']:.2f}{steady} (min {d['ratio']['min']:.2f}, "
                   f"max {d['ratio']['max']:.2f})")
            if engine:
                e = d["ratio_engine"]
                yield ("overhead", f"{shape}: {stage} stage tokens/s / its engine alone on the "
                       "same prompts (the stage's own overhead)", ">= 0.90",
                       f"{e['median']:.2f} (min {e['min']:.2f}, max {e['max']:.2f})")


GROWTH_TARGETED = ("learn_discovery_admission", "score_poll", "prepare_poll", "rollout_checks",
                   "evaluate_poll", "forwarder_tick_bucketed", "doctor_read_bucketed")


def _growth(r: dict) -> Iterator[Row]:
    for backend, b in r["backends"].items():
        objects = f"{b['objects']:,} objects" if "objects" in b else ""
        for poll, p in b["polls"].items():
            target = "<= 1.5" if poll in GROWTH_TARGETED else ""
            yield ("growth", f"{backend} ({objects}): {poll} late / fresh", target,
                   f"{p['ratio']:.2f}")


def _publish(r: dict) -> Iterator[Row]:
    for name, c in r["cases"].items():
        target = "<= 0.10" if c["dtype"] == "bfloat16" and c["lr"] <= 1e-5 else ""
        yield ("publish", f"{name} ({c['params'] / 1e6:.2f}M params, full "
               f"{c['full_bytes'] / 1e6:.2f} MB): delta bytes / full (median)", target,
               f"{c['delta_fraction_median']:.3f}")
        yield ("publish", f"{name}: reload by delta / from the full snapshot", "",
               f"{c['reload_delta_s'] * 1e3:.1f} / {c['reload_full_s'] * 1e3:.1f} ms"
               f"{'' if c['bit_exact'] else ' (NOT bit-exact)'}")


def _memory(r: dict) -> Iterator[Row]:
    for stage, mb in r["peak_rss_mb"].items():
        yield "memory", f"demo: peak RSS of {stage}", "", f"{mb:.0f} MiB"


def _demo(r: dict) -> Iterator[Row]:
    from bench.curves import binomial_se

    for row in r["rows"]:
        at = f" v{row['rl_version']}" if "rl_version" in row else ""
        yield (f"demo seed {row['seed']}",
               f"pass@1 SFT -> RL{at} (SFT continued as long, {row['rl_seconds']:.0f} s, as "
               "control)", "",
               f"{row['sft_plateau']:.3f} -> {row['rl_final']:.3f} ({row['sft_continued']:.3f})")
        n = row.get("heldout_prompts")
        if not n:  # written before the benchmark recorded its evaluation's size
            continue
        rl, control = row["rl_final"], row["sft_continued"]
        # both evaluations draw on the same prompts; the unpaired error ignores that pairing
        se = math.hypot(binomial_se(rl, n), binomial_se(control, n))
        yield (f"demo seed {row['seed']}",
               f"RL - SFT continued, pass@1 points (± unpaired binomial SE, n = {n} each)",
               ">= +10", f"{100 * (rl - control):+.1f} ± {100 * se:.1f}")


def _mismatch(r: dict) -> Iterator[Row]:
    for row in r["rows"]:
        yield ("mismatch", f"{r['config']}, versions published in {row['publish_dtype']}: "
               f"generator vs learner logprob per token at equal version, abs difference mean / p99 / max "
               f"({row['tokens']} tokens)", "",
               f"{row['abs_mean']:.1e} / {row['abs_p99']:.1e} / {row['abs_max']:.1e}")


SECTIONS: dict[str, Callable[[dict], Iterator[Row]]] = {
    "algo": _algo, "store": _store, "async": _async, "trl": _trl, "overhead": _overhead,
    "growth": _growth, "publish": _publish, "memory": _memory, "demo_control": _demo,
    "mismatch": _mismatch,
}


def table() -> str:
    r = json.loads(RESULTS.read_text())
    lines = ["# Benchmark results", ""]
    for key in SECTIONS:
        if "machine" in r.get(key, {}):
            m = r[key]["machine"]
            lines.append(f"- `{key}`: {m['date']}, {m['cpus']} CPUs, Python {m['python']}, "
                         f"torch {m['torch']}, {m['platform']}")
    lines += ["", "| benchmark | figure | target | value |", "|---|---|---|---|"]
    for key, rows in SECTIONS.items():
        if key in r:
            lines += [f"| {' | '.join(row)} |" for row in rows(r[key])]
    if "seconds" in r.get("run_all", {}):
        lines += ["", "Wall clock per benchmark (s): " + ", ".join(
            f"{k} {v:.0f}" for k, v in r["run_all"]["seconds"].items())]
    return "\n".join(lines) + "\n"


def record_memory() -> None:
    """Peak RSS per stage of the newest demo run: the TRL benchmark's last repeat (its runs
    are deleted once read, so the figures come from what it recorded)."""
    from bench.results import RESULTS, merge_results

    rows = json.loads(RESULTS.read_text()).get("trl", {}).get("rows", []) \
        if RESULTS.exists() else []
    for row in reversed(rows):
        if peaks := row.get("shardrl", {}).get("peak_rss_mb"):
            merge_results("memory", {"peak_rss_mb": peaks, "run": f"seed {row.get('seed')}"},
                          RESULTS)
            return
    print("no peak memory recorded by the TRL benchmark's runs: the memory rows are not "
          "updated", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-only", action="store_true", help="rewrite RESULTS.md only")
    args = parser.parse_args()
    if not args.table_only:
        from bench.results import merge_results

        seconds = {}
        for bench in BENCHES:
            started = time.monotonic()
            print(f"== {' '.join(bench)}", flush=True)
            subprocess.run([sys.executable, "-m", *bench], check=True)
            seconds[bench[0].removeprefix("bench.")] = time.monotonic() - started
        merge_results("run_all", {"seconds": seconds})
        record_memory()
    text = table()
    (RESULTS.parent / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
