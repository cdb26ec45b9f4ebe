"""A rollout worker's shards that a stage quarantined leave its backlog.

The learner never commits a shard it could not read, so its groups, counted as waiting,
shrank the worker's cap for good; with a small cap the worker paused forever and the run
stopped."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq

from shardrl.config import load_config
from shardrl.stages.context import StageContext
from shardrl.stages.rollout import LOST_CHECK_S, REMEMBERED_SHARDS, Flow
from shardrl.store import LocalStore
from shardrl.store.records import Progress, WorkerState


def make_flow(tmp_path, exact: bool = True) -> tuple[Flow, StageContext]:
    """Worker 0 of one, synchronous (k=0): its cap is one step's share, 16 kept groups."""
    cfg = load_config("demo", ["learner.max_staleness=0", "rollout.workers=1"])
    ctx = StageContext(stage="rollout", cfg=cfg, run_id="r1", store=LocalStore(tmp_path),
                       worker=0, workers=1)
    return Flow(ctx, WorkerState(), exact=exact), ctx


def quarantine(ctx: StageContext, stage: str, kind: str, worker: int, seq: int) -> None:
    key = ctx.keys.quarantine(stage, ctx.keys.shard(kind, 3, worker, seq))
    ctx.store.put_bytes(key, b"not parquet")
    ctx.store.put_json(key + ".error.json", {"error": "unreadable"})


def test_quarantined_shards_leave_the_backlog(tmp_path, caplog):
    f, ctx = make_flow(tmp_path)
    for seq, (groups, kept) in enumerate([(16, 6), (16, 10), (16, 7)]):
        f.written[seq] = (groups, kept)
        f.groups, f.kept = f.groups + groups, f.kept + kept
    progress = Progress(version=3, groups_by_worker={0: 16}, kept_groups_by_worker={0: 6})
    assert f.cap(progress) == 16
    # shards 1 and 2 wait: 17 kept groups, over the cap of 16: the worker pauses
    assert f.backlog(progress) == 17 and f.full(progress)
    # the learner quarantined shard 1: it will never be committed
    quarantine(ctx, "learn", "ready", 0, 1)
    quarantine(ctx, "learn", "ready", 1, 2)  # another worker's shard: not this one's
    ctx.store.put_json(ctx.keys.quarantine("rollout", ctx.keys.root + "prompts/w00-000004.json"),
                       {})
    with caplog.at_level(logging.WARNING):
        f.pause(0.0)  # the first pause looks
    assert f.lost == {1: (16, 10)}
    assert f.backlog(progress) == 7 and not f.full(progress)
    assert f.waiting_groups(progress) == 16
    assert "learn quarantined this worker's shard" in caplog.text and "w00-000001" in caplog.text
    f.check_lost()  # looking again counts nothing twice
    assert f.backlog(progress) == 7
    # the counts stored with the worker's state stay what it wrote (its reservations)
    assert f.state() == {"groups_written": 48, "kept_written": 23}


def test_a_shard_written_before_a_restart_counts_at_the_keep_rate(tmp_path):
    f, ctx = make_flow(tmp_path)
    f.groups, f.kept = 64, 16  # from the stored state: a quarter of the groups kept
    quarantine(ctx, "learn", "ready", 0, 7)
    f.check_lost()
    assert f.lost == {7: (16, 4.0)}  # 16 prompts per shard, at a keep rate of 1/4


def test_a_readable_shard_written_before_a_restart_counts_as_its_file_says(tmp_path):
    """A shard quarantined for its values still reads as a table: its own counts leave the
    backlog, not an average shard's, which would leave the cap off for good."""
    f, ctx = make_flow(tmp_path)
    f.groups, f.kept = 64, 16  # a keep rate of 1/4, as above
    table = pa.table({"group_id": ["g1", "g1", "g2", "g2", "g3", "g3"],
                      "keep": [True, True, False, False, True, True]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    key = ctx.keys.quarantine("learn", ctx.keys.shard("ready", 3, 0, 7))
    ctx.store.put_bytes(key, sink.getvalue().to_pybytes())
    f.check_lost()
    assert f.lost == {7: (3, 2)}  # 3 groups, 2 of them kept


def test_staged_post_processing_counts_a_rollout_shard_score_quarantined(tmp_path):
    f, ctx = make_flow(tmp_path, exact=False)
    f.wrote(0, 16, None)
    f.wrote(1, 16, None)
    quarantine(ctx, "score", "rollouts", 0, 0)
    progress = Progress(version=0)
    before = f.waiting_groups(progress)
    f.check_lost()
    assert f.waiting_groups(progress) == before - 16 == 16
    assert f.backlog(progress) == 16  # what the learner has not seen, at a keep rate of 1


def test_the_worker_looks_again_only_after_pausing_a_while(tmp_path):
    f, ctx = make_flow(tmp_path)
    f.pause(0.0)
    quarantine(ctx, "learn", "ready", 0, 0)
    f.pause(0.0)
    assert f.lost == {}  # not yet: LOST_CHECK_S of pausing since the last look
    f.paused_s += LOST_CHECK_S
    f.pause(0.0)
    assert 0 in f.lost


def test_a_worker_remembers_the_counts_of_its_newest_shards_only(tmp_path):
    f, _ = make_flow(tmp_path)
    for seq in range(REMEMBERED_SHARDS + 3):
        f.wrote(seq, 16, None)
    assert len(f.written) == REMEMBERED_SHARDS
    assert min(f.written) == 3 and max(f.written) == REMEMBERED_SHARDS + 2


def test_pause_lines_come_at_most_once_a_minute(tmp_path, monkeypatch):
    from shardrl.stages import rollout

    f, ctx = make_flow(tmp_path)
    now = [100.0]
    monkeypatch.setattr(rollout.time, "monotonic", lambda: now[0])
    lines: list[str] = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    pauses = rollout.PauseLog(Log(), f, every=60.0)
    pauses.pausing("17 kept groups not yet committed (cap 16)")
    assert lines == ["pausing: 17 kept groups not yet committed (cap 16)"]
    for _ in range(29):  # a pause every 2 s, paused 1 s of each
        now[0] += 2.0
        f.paused_s += 1.0
        pauses.pausing("18 kept groups not yet committed (cap 16)")
    assert len(lines) == 1
    now[0] += 2.0
    f.paused_s += 1.0
    pauses.pausing("19 kept groups not yet committed (cap 16)")
    assert lines[1:] == ["pausing: 19 kept groups not yet committed (cap 16) "
                         "(30 pauses in the last 60 s, 50% of it paused)"]
