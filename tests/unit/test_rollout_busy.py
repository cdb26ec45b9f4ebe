"""A rollout worker's busy accounting: busy is every second not paused on the backlog."""

import pytest

from shardrl.config import load_config
from shardrl.stages.context import StageContext
from shardrl.stages.rollout import Flow
from shardrl.store import LocalStore
from shardrl.store.records import WorkerState


def test_busy_is_wall_time_less_pauses_and_generation_is_counted_apart(tmp_path, monkeypatch):
    now = [50.0]
    monkeypatch.setattr("shardrl.stages.rollout.time.monotonic", lambda: now[0])
    ctx = StageContext(stage="rollout", cfg=load_config("demo"), run_id="r1",
                       store=LocalStore(tmp_path))
    flow = Flow(ctx, WorkerState(), exact=True)

    class Watch:  # a pause that lasts 3 s of the fake clock
        def wait(self, timeout):
            now[0] += 3.0

    flow.arrivals = Watch()
    now[0] += 2.0  # loading weights, encoding prompts: work, not a pause
    flow.generated(4.0)
    now[0] += 4.0  # the generation batch itself
    flow.pause(0.5)
    now[0] += 1.0
    # 10 s since the first policy: 3 paused, 7 busy, 4 of them inside generation batches
    assert flow.paused_s == 3.0 and flow.generating_s == 4.0
    assert flow.busy_s == pytest.approx(7.0)
    assert flow.busy_fraction() == pytest.approx(0.7)
    flow.sampled(0.25)  # the sampling calls' CPU seconds add up, apart from the wall times
    flow.sampled(0.5)
    assert flow.sampling_cpu_s == 0.75 and flow.generating_s == 4.0
