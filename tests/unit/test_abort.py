"""The abort marker: its key, first failure kept, and how a stage's context sees it."""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from shardrl.config import load_config
from shardrl.stages.context import ABORT_CHECK_S, StageContext
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import Aborted, Done


def test_the_first_failure_is_kept(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    assert keys.aborted() == "runs/r1/ABORTED.json"
    first = Aborted(stage="rollout", worker=1, exit_code=137, restarts=3, reason="oom", time=1.0)
    assert first.write_first(store, keys.aborted()) == first
    later = Aborted(stage="learn", exit_code=1, restarts=3, time=2.0)
    assert later.write_first(store, keys.aborted()) == first  # not overwritten
    assert Aborted.read(store, keys.aborted()) == first
    assert first.describe() == "rollout worker 1 failed for good (exit 137 after 3 restart(s)): oom"
    assert later.describe() == "learn failed for good (exit 1 after 3 restart(s))"


def test_of_failures_recorded_at_once_one_wins_and_all_report_it(tmp_path):
    """The marker was looked for, then written: two failures at once both wrote, the later
    won, and each caller reported its own as the run's cause."""
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    markers = [Aborted(stage="rollout", worker=w, exit_code=1, time=float(w)) for w in range(8)]
    start = threading.Barrier(len(markers))

    def record(marker: Aborted) -> Aborted:
        start.wait()
        return marker.write_first(store, keys.aborted())

    with ThreadPoolExecutor(len(markers)) as pool:
        in_force = list(pool.map(record, markers))
    stored = Aborted.read(store, keys.aborted())
    assert all(m == stored for m in in_force)
    assert stored in markers
    assert not [p for p in (tmp_path / "runs" / "r1").iterdir() if p.name.startswith(".")]


def test_a_stage_sees_the_marker_within_the_check_interval(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    ctx = StageContext(stage="evaluate", cfg=load_config("demo"), run_id="r1", store=store,
                       log=logging.getLogger("test"))
    now = [100.0]
    monkeypatch.setattr("shardrl.stages.context.time.monotonic", lambda: now[0])
    assert ctx.aborted() is None and not ctx.done()
    Aborted(stage="learn", exit_code=1).write(store, ctx.keys.aborted())
    now[0] += ABORT_CHECK_S / 2
    assert ctx.aborted() is None  # not looked up again yet: a poll loop calls it often
    now[0] += ABORT_CHECK_S / 2
    assert ctx.aborted().stage == "learn"
    assert ctx.done()  # looping stages stop as on DONE.json
    store.delete(ctx.keys.aborted())
    assert ctx.aborted() is not None  # remembered once seen


def test_done_alone_still_ends_the_loops(tmp_path):
    store = LocalStore(tmp_path)
    ctx = StageContext(stage="rollout", cfg=load_config("demo"), run_id="r1", store=store)
    Done(steps=3).write(store, ctx.keys.done())
    assert ctx.done() and ctx.aborted() is None


def test_the_monitor_task_ends_on_the_marker(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from shardrl.orchestrate import kfp_tasks, monitor

    ticks = []

    class Forwarder:  # the MLflow side is not what this checks
        def __init__(self, view, progress_bar):
            pass

        def tick(self):
            ticks.append(1)
            if len(ticks) == 2:
                Aborted(stage="rollout").write(store, keys.aborted())

        def finish_metrics(self, final=True):
            ticks.append(("finished", final))

    store, keys = LocalStore(tmp_path), RunKeys("r1")
    monkeypatch.setattr(monitor, "Monitor", Forwarder)
    monkeypatch.setattr(kfp_tasks, "link_runs", lambda monitor, view: None)
    assert kfp_tasks.follow(SimpleNamespace(store=store, keys=keys), poll_s=0.01) == 0
    assert ticks == [1, 1, ("finished", True)]  # aborted: no report task will send the rest
