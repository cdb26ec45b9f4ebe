"""Peak RSS per stage from a fake /proc: tree sums, high-water marks kept, restarts, summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrl.orchestrate.rss import (
    SUMMARY_FIELD,
    TICKS,
    PeakRss,
    descendants,
    machine_share,
    parent_map,
    record,
    summary_line,
    vm_hwm_kb,
)
from shardrl.store import LocalStore, RunKeys


def fake_process(proc: Path, pid: int, ppid: int, hwm_kb: int | None, comm: str = "python",
                 ticks: tuple[int, int] = (0, 0)) -> None:
    """/proc/<pid>/stat and status as Linux writes them (the fields read here: ppid, and
    utime and stime in clock ticks)."""
    d = proc / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    utime, stime = ticks
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194304 97 0 0 0 "
                            f"{utime} {stime} 0 0 20 0 1 0\n")
    status = f"Name:\t{comm}\nPPid:\t{ppid}\n"
    if hwm_kb is not None:  # a zombie has no memory lines
        status += f"VmHWM:\t{hwm_kb:>8} kB\nVmRSS:\t{hwm_kb // 2:>8} kB\n"
    (d / "status").write_text(status)


def fake_proc(tmp_path: Path) -> Path:
    """runner 100 -> learn 200 (torchrun) -> ranks 201, 202; runner -> rollout 300 and 400."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "status").write_text("Name:\tpython\n")
    fake_process(proc, 1, 0, 1000)
    fake_process(proc, 100, 1, 50_000)
    fake_process(proc, 200, 100, 10_240, comm="torch run (x)")  # ")" and spaces in comm
    fake_process(proc, 201, 200, 204_800)
    fake_process(proc, 202, 200, 102_400)
    fake_process(proc, 300, 100, 51_200)
    fake_process(proc, 400, 100, 40_960)
    return proc


def test_status_and_tree_parsing(tmp_path: Path):
    proc = fake_proc(tmp_path)
    assert vm_hwm_kb(201, proc) == 204_800
    assert vm_hwm_kb(999, proc) is None  # gone
    fake_process(proc, 203, 200, None)
    assert vm_hwm_kb(203, proc) is None  # zombie
    parents = parent_map(proc)
    assert parents[200] == 100 and parents[201] == 200 and 1 in parents
    assert descendants(200, parents) == [200, 203, 202, 201]
    assert descendants(300, parents) == [300]


def test_peaks_sum_the_tree_keep_maxima_and_take_the_largest_incarnation(tmp_path: Path):
    proc = fake_proc(tmp_path)
    rss = PeakRss(proc)
    rss.sample([("learn", 0, 200), ("rollout", 0, 300), ("rollout", 1, 400)])
    # a rank's high-water mark rises, another rank exits (its last value stays counted)
    fake_process(proc, 201, 200, 307_200)
    (proc / "202" / "status").unlink()
    (proc / "202" / "stat").unlink()
    # rollout worker 1 crashed; its restart (pid 500) peaks lower than the first incarnation
    fake_process(proc, 500, 100, 30_720)
    rss.sample([("learn", 0, 200), ("rollout", 0, 300), ("rollout", 1, 500)])
    peaks = rss.stage_mb()
    # learn: (10240 + 307200 + 102400) KiB / 1024 = 10 + 300 + 100 = 410 MiB
    # rollout: worker 0 51200/1024 = 50, worker 1 max(40960, 30720)/1024 = 40 -> 90 MiB
    assert peaks == {"learn": 410.0, "rollout": 90.0}
    assert summary_line(peaks) == "peak RSS          learn 410 MiB, rollout 90 MiB"


def test_record_merges_into_the_summary(tmp_path: Path):
    proc = fake_proc(tmp_path)
    fake_process(proc, os.getpid(), 1, 20_480)  # the runner: 20 MiB
    store, keys = LocalStore(str(tmp_path / "store")), RunKeys("r")
    key = keys.state("runner", "summary.json")
    store.put_json(key, {"accounting": {"balanced": True}})
    rss = PeakRss(proc)
    rss.sample([("snapshot", 0, 300)])
    line = record(store, keys, rss)
    assert store.get_json(key) == {"accounting": {"balanced": True}, "cpu_s": {"snapshot": 0.0},
                                   SUMMARY_FIELD: {"snapshot": 50.0, "runner": 20.0}}
    assert line == "peak RSS          snapshot 50 MiB, runner 20 MiB"


def test_cpu_time_sums_every_process_and_incarnation_and_gives_the_machine_share(tmp_path):
    proc = fake_proc(tmp_path)
    hz = TICKS
    fake_process(proc, 200, 1, 1000, ticks=(3 * hz, 1 * hz))  # learn: 4 s
    fake_process(proc, 300, 1, 1000, ticks=(5 * hz, 0))  # rollout: 5 s, and its child 1 s
    fake_process(proc, 301, 300, 1000, ticks=(hz // 2, hz // 2))
    rss = PeakRss(proc)
    rss.sample([("learn", 0, 200), ("rollout", 0, 300)])
    fake_process(proc, 300, 1, 1000, ticks=(7 * hz, 0))  # later: 7 s
    rss.sample([("learn", 0, 200), ("rollout", 0, 300)])
    rss.exited("learn", 200, 4.5)  # reaped: the exact figure replaces the last sample
    fake_process(proc, 400, 1, 1000, ticks=(2 * hz, 0))  # a restarted rollout: 2 s more
    rss.sample([("rollout", 0, 400)])
    cpu = rss.stage_cpu_s()
    assert cpu == {"learn": 4.5, "rollout": 7 + 1 + 2}
    # 14.5 s of RL-phase work on 2 cores over 10 s; snapshot time is not RL-phase work
    assert machine_share(cpu | {"snapshot": 30.0}, 10.0, 2) == 0.725


def test_record_adds_the_rl_phase_and_its_machine_share(tmp_path: Path):
    proc = fake_proc(tmp_path)
    fake_process(proc, os.getpid(), 1, 20_480)
    fake_process(proc, 200, 1, 1000, ticks=(8 * TICKS, 0))
    store, keys = LocalStore(str(tmp_path / "store")), RunKeys("r")
    store.put_json(keys.run_json(), {"created": 100.0, "snapshot_seconds": 5.0})
    store.put_json(keys.done(), {"time": 115.0, "steps": 3})
    rss = PeakRss(proc)
    rss.sample([("learn", 0, 200)])
    line = record(store, keys, rss)
    summary = store.get_json(keys.state("runner", "summary.json"))
    cores = len(os.sched_getaffinity(0))
    assert summary["rl_wall_s"] == 10.0 and summary["cpu_s"] == {"learn": 8.0}
    assert summary["machine_share"] == round(8.0 / (cores * 10.0), 3)
    assert line.endswith(f"learn 8.0 s: {8.0 / (cores * 10.0):.2f} of {cores} cores x 10.0 s "
                         "(stage start-up included)")
    # the runner's own CPU while it supervised: shown beside the stages, not in the share
    rss.runner_cpu_s = 1.234
    line = record(store, keys, rss)
    summary = store.get_json(keys.state("runner", "summary.json"))
    assert summary["cpu_s"] == {"learn": 8.0, "runner": 1.23}
    assert summary["machine_share"] == round(8.0 / (cores * 10.0), 3)
    assert line.endswith("(stage start-up included); the runner 1.2 s")


def test_the_share_is_measured_between_the_rl_phases_edges(tmp_path: Path):
    """Start-up before the RL phase and the work after DONE are not part of its share."""
    proc = fake_proc(tmp_path)
    fake_process(proc, os.getpid(), 1, 20_480)
    store, keys = LocalStore(str(tmp_path / "store")), RunKeys("r")
    store.put_json(keys.run_json(), {"created": 100.0, "snapshot_seconds": 5.0})
    store.put_json(keys.done(), {"time": 115.0, "steps": 3})
    now = [105.0]
    rss = PeakRss(proc, clock=lambda: now[0])
    fake_process(proc, 200, 1, 1000, ticks=(3 * TICKS, 0))  # start-up: 3 s before the phase
    rss.sample([("learn", 0, 200)])
    rss.mark("start")
    fake_process(proc, 200, 1, 1000, ticks=(12 * TICKS, 0))
    fake_process(proc, 300, 1, 1000, ticks=(6 * TICKS, 0))  # a worker that started later
    rss.sample([("learn", 0, 200), ("rollout", 0, 300)])
    now[0] = 113.0
    rss.mark("end")
    rss.mark("end")  # once: a later call changes nothing
    now[0] = 120.0
    rss.runner_cpu_s = 0.5
    line = record(store, keys, rss)
    summary = store.get_json(keys.state("runner", "summary.json"))
    cores = len(os.sched_getaffinity(0))
    # 9 s of learn and 6 s of rollout over the 8 s between the marks
    assert summary["rl_cpu_s"] == {"learn": 9.0, "rollout": 6.0, "runner": 0.5}
    assert summary["rl_window_s"] == 8.0
    assert summary["machine_share"] == round(15.0 / (cores * 8.0), 3)
    assert summary["cpu_s"]["learn"] == 12.0  # the stages' whole lives stay in cpu_s
    assert line.endswith(f"rollout 6.0 s, learn 9.0 s: {15.0 / (cores * 8.0):.2f} of {cores} "
                         "cores x 8.0 s; the runner 0.5 s")


def test_without_proc_nothing_is_sampled(tmp_path: Path):
    rss = PeakRss(tmp_path / "no-proc")
    rss.sample([("learn", 0, 1)])
    assert rss.stage_mb() == {}
    assert summary_line({}) == "peak RSS          not sampled"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_real_tree_counts_its_child(tmp_path: Path):
    """A parent whose child holds 200 MiB: the tree's peak includes the child's 200 MiB."""
    flag = tmp_path / "ready"
    child = (f"b = b'x' * (200 << 20); open({str(flag)!r}, 'w').close(); "
             "import time; time.sleep(60)")
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rss = PeakRss()
        rss.sample([("learn", 0, parent.pid)])
        (tree,) = rss.peaks[("learn", 0)].values()
        assert len(tree) == 2  # the parent and its child
        assert 200 < rss.stage_mb()["learn"] < 1000
    finally:
        for pid in descendants(parent.pid, parent_map())[::-1]:
            os.kill(pid, signal.SIGKILL)
        parent.wait()
