"""Peak resident memory (RSS) of the stages of a local run, sampled from /proc (Linux).

A process's `VmHWM` (in /proc/<pid>/status) is its resident-set high-water mark: it only
grows, and it vanishes with the process, so the runner samples it while the stages run and
keeps the largest value seen per process. A stage replica is a process tree (a DeepSpeed
learner under torchrun has one child per rank), so a replica's peak is the sum over the
processes of its tree of their peaks; summing high-water marks reached at different moments
gives an upper bound of the tree's true peak. A stage's figure is the sum over its replicas;
a restarted replica counts with its largest incarnation. Elsewhere than Linux nothing is
recorded.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

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

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self.enabled = (proc / "self" / "status").exists()
        self.peaks: dict[tuple[str, int], dict[int, dict[int, int]]] = defaultdict(dict)
        """(stage, worker) -> root pid of an incarnation -> pid in its tree -> peak KiB."""

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
    store.put_json(key, summary | {SUMMARY_FIELD: peaks})
    return summary_line(peaks)
