"""Peak resident memory (RSS) of the stages of a local run, sampled from /proc (Linux).

A process's `VmHWM` (in /proc/<pid>/status) is its resident-set high-water mark: it only
grows, and it vanishes with the process, so the runner samples it while the stages run and
keeps the largest value seen per process. A stage replica is a process tree (a DeepSpeed
learner under torchrun has one child per rank), so a replica's peak is the sum over the
processes of its tree of their peaks; summing high-water marks reached at different moments
gives an upper bound of the tree's true peak. A stage's figure is the sum over its replicas;
a restarted replica counts with its largest incarnation. Elsewhere than Linux nothing is
recorded.

The same samples give each stage's CPU time (user + system, /proc/<pid>/stat), summed over
every process of every incarnation: the work the stage did, which divided by cores x wall
time is the share of the machine a run used. A process's last moments after its last sample
are missed, except for forked stages, whose exact figure the runner reads when it reaps
them (`exited`).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ..graph import LOOPING
from ..store import RunKeys, Store

PROC = Path("/proc")
SUMMARY_FIELD = "peak_rss_mb"
"""Key of the per-stage peaks (MiB) in `state/runner/summary.json`."""
RUNNER = "runner"
"""The entry of the runner process itself (its own peak, without the stages below it)."""

def vm_hwm_kb(pid: int, proc: Path = PROC) -> int | None:
    """Peak resident set of `pid` in KiB, None when it is gone (or a zombie, which has none)."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int, proc: Path = PROC) -> float | None:
    """User + system CPU seconds of `pid` (all its threads), None when it is gone."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15
    except (OSError, IndexError, ValueError):
        return None


def parent_map(proc: Path = PROC) -> dict[int, int]:
    """{pid: parent pid} of every process visible in `proc`."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")"
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process below it in the tree `parents` describes, root first."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parents.items():
        children[ppid].append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(sorted(children.get(pid, ())))
    return tree


class PeakRss:
    """Largest VmHWM seen per process, grouped by stage replica and incarnation."""

    def __init__(self, proc: Path = PROC, clock=time.time) -> None:
        self.proc, self.clock = proc, clock
        self.enabled = (proc / "self" / "status").exists()
        self.peaks: dict[tuple[str, int], dict[int, dict[int, int]]] = defaultdict(dict)
        """(stage, worker) -> root pid of an incarnation -> pid in its tree -> peak KiB."""
        self.cpu: dict[str, dict[int, float]] = defaultdict(dict)
        """stage -> pid -> CPU seconds (largest seen, or exact at exit)."""
        self.window: dict[str, tuple[float, dict[str, float]]] = {}
        """"start" and "end" of the RL phase as this runner saw it: (epoch seconds, each
        stage's CPU seconds then), sampled just before (see `mark`)."""
        self.runner_cpu_s: float | None = None
        """The runner's own CPU seconds while it supervised the looping stages (forwarding
        metrics, polling, sampling these figures): not part of the machine share."""

    def sample(self, running: Iterable[tuple[str, int, int]]) -> None:
        """Read the high-water marks of the trees of `running` (stage, worker, root pid)."""
        running = list(running)
        if not self.enabled or not running:
            return
        parents = parent_map(self.proc)
        for name, worker, root in running:
            tree = self.peaks[(name, worker)].setdefault(root, {})
            for pid in descendants(root, parents):
                kb = vm_hwm_kb(pid, self.proc)
                if kb is not None:
                    tree[pid] = max(kb, tree.get(pid, 0))
                seconds = cpu_seconds(pid, self.proc)
                if seconds is not None:
                    self.cpu[name][pid] = max(seconds, self.cpu[name].get(pid, 0.0))

    def exited(self, name: str, pid: int, cpu_s: float) -> None:
        """A stage process was reaped and its exact CPU time (with its own children's) is known."""
        self.cpu[name][pid] = cpu_s

    def mark(self, edge: str) -> None:
        """Record the stages' CPU seconds now as the RL phase's `edge` ("start": the runner
        began supervising the looping stages; "end": it first saw DONE.json), once each."""
        if self.enabled and edge not in self.window:
            self.window[edge] = (self.clock(), self.stage_cpu_s())

    def window_cpu_s(self) -> tuple[float, dict[str, float]] | None:
        """(seconds, {stage: CPU seconds}) between the marks: the RL phase's own CPU, without
        what the stages spent starting up before it or finishing after it. None unmarked."""
        if "start" not in self.window or "end" not in self.window:
            return None
        (t0, before), (t1, after) = self.window["start"], self.window["end"]
        if t1 - t0 < 1.0:  # resumed after the end: no RL phase to speak of
            return None
        return t1 - t0, {n: round(v - before.get(n, 0.0), 2) for n, v in after.items()}

    def stage_cpu_s(self) -> dict[str, float]:
        """{stage: CPU seconds over all its processes and incarnations}."""
        return {name: round(sum(pids.values()), 2) for name, pids in self.cpu.items()}

    def stage_mb(self) -> dict[str, float]:
        """{stage: MiB}: per replica the largest incarnation's tree sum, summed over replicas."""
        totals: dict[str, float] = defaultdict(float)
        for (name, _), incarnations in self.peaks.items():
            if incarnations:
                totals[name] += max(sum(t.values()) for t in incarnations.values()) / 1024
        return {name: round(mb, 1) for name, mb in totals.items()}


def summary_line(peaks_mb: dict[str, float]) -> str:
    """The closing summary's line, e.g. `peak RSS          rollout 312 MiB, learn 401 MiB`."""
    text = ", ".join(f"{name} {mb:.0f} MiB" for name, mb in peaks_mb.items()) or "not sampled"
    return f"peak RSS          {text}"


def record(store: Store, keys: RunKeys, rss: PeakRss) -> str:
    """Add the peaks (and the runner's own) to the run's summary.json; the summary line."""
    peaks = rss.stage_mb()
    own = vm_hwm_kb(os.getpid(), rss.proc) if rss.enabled else None
    if own is not None:
        peaks[RUNNER] = round(own / 1024, 1)
    key = keys.state("runner", "summary.json")
    summary = store.get_json(key) if store.exists(key) else {}
    summary |= {SUMMARY_FIELD: peaks, "cpu_s": rss.stage_cpu_s()}
    if rss.runner_cpu_s is not None:
        summary["cpu_s"][RUNNER] = round(rss.runner_cpu_s, 2)
    if store.exists(keys.done()) and store.exists(keys.run_json()):
        run = store.get_json(keys.run_json())
        if "snapshot_seconds" in run:  # the RL phase: policy v0 published -> DONE.json
            start = run["created"] + run["snapshot_seconds"]
            summary["rl_wall_s"] = round(store.get_json(keys.done())["time"] - start, 3)
    line = summary_line(peaks)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    window = rss.window_cpu_s()
    if window is not None:  # the share over the RL phase alone, sampled at its edges
        seconds, cpu = window
        if rss.runner_cpu_s is not None:
            cpu[RUNNER] = round(rss.runner_cpu_s, 2)
        summary |= {"rl_cpu_s": cpu, "rl_window_s": round(seconds, 3),
                    "machine_share": machine_share(cpu, seconds, cores)}
        line += "\n" + cpu_line(cpu, seconds, cores, "")
    elif "rl_wall_s" in summary:
        summary["machine_share"] = machine_share(summary["cpu_s"], summary["rl_wall_s"], cores)
        line += "\n" + cpu_line(summary["cpu_s"], summary["rl_wall_s"], cores)
    store.put_json(key, summary)
    return line


def machine_share(cpu_s: dict[str, float], wall_s: float, cores: int) -> float:
    """CPU seconds of the RL phase's (looping) stages over cores x the phase's wall clock."""
    work = sum(v for name, v in cpu_s.items() if name in LOOPING)
    return round(work / max(cores * wall_s, 1e-9), 3)


def cpu_line(cpu_s: dict[str, float], wall_s: float, cores: int,
             note: str = " (stage start-up included)") -> str:
    """The closing summary's CPU line: each RL stage's CPU time, the machine share, and the
    runner's own CPU time when known."""
    parts = ", ".join(f"{n} {cpu_s[n]:.1f} s" for n in LOOPING if n in cpu_s)
    share = machine_share(cpu_s, wall_s, cores)
    runner = f"; the runner {cpu_s[RUNNER]:.1f} s" if RUNNER in cpu_s else ""
    return (f"CPU in RL phase   {parts}: {share:.2f} of {cores} cores x {wall_s:.1f} s"
            f"{note}{runner}")
