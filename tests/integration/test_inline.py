"""Inline post-processing: a rollout worker writes the ready shards the score and prepare
stages would have written (with `inline_shards: all` the rollout and scored shards too), and
finishes a shard a crash left without its ready shard."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from shardrl.config import load_config
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.stages.inline import InlinePostprocess, kept_groups
from shardrl.stages.prepare import Preparer
from shardrl.stages.score import Scorer
from shardrl.store import LocalStore, RunKeys, read_shard, write_shard
from shardrl.store.schemas import READY, ROLLOUT, SCORED


def rollout_table(version: int, worker: int, seq: int) -> pa.Table:
    """Two groups of 4: the first mixed (2 right, 2 wrong), the second all wrong."""
    rows = 8
    right = [True, False, True, False, False, False, False, False]
    return pa.table({
        "prompt_id": [f"p{seq}-{i // 4}" for i in range(rows)],
        "group_id": [f"w{worker:02d}-{seq:06d}-{i // 4:03d}" for i in range(rows)],
        "sample_idx": pa.array([i % 4 for i in range(rows)], pa.int32()),
        "policy_version": pa.array([version] * rows, pa.int64()),
        "worker": pa.array([worker] * rows, pa.int32()),
        "prompt_text": ["abc="] * rows,
        "prompt_token_ids": pa.array([[1, 2, 3]] * rows, pa.list_(pa.int32())),
        "response_token_ids": pa.array([[5, 6]] * rows, pa.list_(pa.int32())),
        "behavior_logprobs": pa.array([[-0.5, -0.25]] * rows, pa.list_(pa.float32())),
        "finish_reason": ["stop"] * rows,
        "response_text": ["bcd" if r else "bce" for r in right],
        "answer": ["bcd"] * rows,
        "category": ["c"] * rows,
        "created_at": [1.7e9] * rows,
    }, schema=ROLLOUT)


def context(tmp_path, stage: str, *overrides: str) -> StageContext:
    cfg = load_config("demo", ["tracking.enabled=false", "rollout.workers=1", *overrides])
    store = LocalStore(tmp_path / "store")
    ctx = StageContext(stage=stage, cfg=cfg, run_id="r", store=store)
    ctx.metrics = MetricsSink(store, ctx.keys, stage, 0)
    return ctx


def test_inline_shards_equal_what_the_stages_write(tmp_path):
    ctx = context(tmp_path, "rollout")
    assert ctx.cfg.inline_postprocess
    table = rollout_table(3, 0, 7)
    scored, ready = InlinePostprocess(ctx).process(table)
    stage_scored = Scorer(context(tmp_path / "s", "score")).score(table)
    stage_ready = Preparer(context(tmp_path / "p", "prepare")).prepare(stage_scored)
    assert scored.equals(stage_scored) and ready.equals(stage_ready)
    # the mixed group is kept with advantages of opposite signs, the all-wrong one filtered
    assert ready.column("keep").to_pylist() == [True] * 4 + [False] * 4
    assert ready.column("correct").to_pylist()[:4] == [True, False, True, False]
    adv = ready.column("advantage").to_pylist()
    assert adv[0] > 0 > adv[1] and adv[4:] == [0.0] * 4
    assert kept_groups(ready) == 1


def test_by_default_the_ready_shard_alone_is_written_and_holds_the_earlier_columns(tmp_path):
    ctx = context(tmp_path, "rollout")
    assert ctx.cfg.rollout.inline_shards == "ready"
    store, keys, post = ctx.store, ctx.keys, InlinePostprocess(ctx)
    key = keys.rollout(3, 0, 7)
    table = rollout_table(3, 0, 7)
    scored, ready = post.process(table)
    post.write(key, table, scored, ready, post.preparer.record(key, ready))
    assert not store.exists(key) and not store.exists(keys.scored_for(key))
    stored = read_shard(store, keys.ready_for(key), READY)
    assert stored.select(ROLLOUT.names).equals(table)
    assert stored.select(SCORED.names).equals(scored.cast(SCORED))
    # the demo's prepare keeps no statistics across shards (no reward normalization, no
    # pass-rate history): the ready shard is the only write
    assert not post.preparer.stateful and post.preparer.recent == []
    assert store.list(keys.root + "state/prepare/") == []
    # with running reward moments, the shard is recorded in the preparer's saved state
    moments = InlinePostprocess(context(tmp_path / "norm", "rollout",
                                        "algo.shaping.normalize=true"))
    scored, ready = moments.process(table)
    moments.write(key, table, scored, ready, moments.preparer.record(key, ready))
    assert moments.preparer.recent == ["w00-000007.parquet"]
    saved = moments.ctx.store.get_json(keys.state("prepare", "state.json"))
    assert saved["recent"] == ["w00-000007.parquet"] and saved["moments"]["count"] == 8
    # with `all`, the rollout and scored shards come first, as the stages would write them
    every = InlinePostprocess(context(tmp_path / "all", "rollout", "rollout.inline_shards=all"))
    every.write(key, table, scored, ready, every.preparer.record(key, ready))
    assert read_shard(every.ctx.store, key, ROLLOUT).equals(table)
    assert read_shard(every.ctx.store, keys.scored_for(key), SCORED).equals(scored.cast(SCORED))


def test_a_rollout_shard_left_without_its_ready_shard_is_finished_on_restart(tmp_path):
    # running reward moments: the preparer's state records the shards it merged
    ctx = context(tmp_path, "rollout", "rollout.inline_shards=all", "algo.shaping.normalize=true")
    store, keys = ctx.store, RunKeys("r")
    done, orphan = keys.rollout(2, 0, 4), keys.rollout(3, 0, 5)
    other_worker = keys.rollout(3, 1, 0)
    post = InlinePostprocess(ctx)
    for key in (done, orphan, other_worker):
        write_shard(store, key, rollout_table(int(key.split("/v")[1][:6]), 0, 1), ROLLOUT)
    scored, ready = post.process(read_shard(store, done, ROLLOUT))
    post.write(done, None, scored, ready, post.preparer.record(done, ready))
    assert not store.exists(keys.ready_for(orphan))  # as a kill between the writes leaves it
    restarted = InlinePostprocess(ctx)  # a new process: the preparer state from the store
    assert restarted.preparer.recent == ["w00-000004.parquet"]
    restarted.recover(last_version=3, newest=3)
    finished = read_shard(store, keys.ready_for(orphan), READY)
    assert read_shard(store, keys.scored_for(orphan), SCORED).num_rows == 8
    assert pc.sum(finished.column("keep")).as_py() == 4
    assert restarted.preparer.recent == ["w00-000004.parquet", "w00-000005.parquet"]
    # another worker's shard is that worker's to finish
    assert not store.exists(keys.ready_for(other_worker))
    # nothing is redone once finished
    restarted.recover(last_version=3, newest=3)
    assert restarted.preparer.recent == ["w00-000004.parquet", "w00-000005.parquet"]
    # nor a ready shard the learner quarantined: its samples must not come back as new ones
    bad = keys.ready_for(orphan)
    store.put_bytes(keys.quarantine("learn", bad), store.get_bytes(bad))
    store.delete(bad)
    InlinePostprocess(ctx).recover(last_version=3, newest=3)
    assert not store.exists(bad)


def npr_shard(seq: int, easy_right: bool) -> pa.Table:
    """Group 0 asks prompt "easy" (all 4 right or all 4 wrong), group 1 a new prompt each
    shard (2 right, 2 wrong)."""
    table = rollout_table(0, 0, seq)
    right = [easy_right] * 4 + [True, False, True, False]
    table = table.set_column(0, "prompt_id", pa.array(["easy"] * 4 + [f"new{seq}"] * 4))
    return table.set_column(table.schema.get_field_index("response_text"), "response_text",
                            pa.array(["bcd" if r else "bce" for r in right]))


def test_pass_rate_history_and_retired_set_are_stored_incrementally(tmp_path):
    """The history is a snapshot plus the ready shards merged since; the retired set a
    series of changes that a reader follows from where it stopped; a restarted preparer
    rebuilds exactly the history it had."""
    from shardrl.stages.prepare import SNAPSHOT_MIN
    from shardrl.stages.rollout import RetiredPrompts

    npr = "algo.filters.no_positive_resampling"
    ctx = context(tmp_path, "rollout", f"{npr}.enabled=true", f"{npr}.window=4",
                  f"{npr}.retire_at=0.75", f"{npr}.min_samples=4")
    store, keys = ctx.store, ctx.keys
    post = InlinePostprocess(ctx)
    early_reader, late_reader = RetiredPrompts(store, keys), RetiredPrompts(store, keys)
    for seq in range(20):
        key = keys.rollout(0, 0, seq)
        table = npr_shard(seq, easy_right=True)
        scored, ready = post.process(table)
        post.write(key, table, scored, ready, post.preparer.record(key, ready))
        if seq == 3:
            assert early_reader.refresh() == {"easy"}
    tracker = post.preparer.tracker
    assert tracker.retired() == {"easy"} and len(tracker) == 21
    # snapshots after 8 and 16 shards (8 shards of 8 samples outnumber the 9 to 17 prompts):
    # only the newest is kept, and only the retired changes from its full set on
    state = ctx.store.get_json(post.preparer.state_key)
    assert SNAPSHOT_MIN == 8 and state["passrate_snapshot"] == 2
    assert state["replay"] == [keys.ready_for(keys.rollout(0, 0, s)) for s in range(16, 20)]
    assert [k.rsplit("/", 1)[1] for k in store.list(keys.root + "state/prepare/passrate-")] == \
        ["passrate-000002.json"]
    changes = store.list(keys.retired_prefix())
    assert store.get_json(changes[0]) == {"full": True, "add": ["easy"], "remove": []}
    assert len(changes) == 1  # nothing changed after the second snapshot
    assert early_reader.refresh() == late_reader.refresh() == {"easy"}

    # a restarted preparer: snapshot + replay give the same history
    restarted = Preparer(context(tmp_path, "prepare", f"{npr}.enabled=true", f"{npr}.window=4",
                                 f"{npr}.retire_at=0.75", f"{npr}.min_samples=4"))
    assert restarted.tracker.state_dict() == tracker.state_dict()
    assert restarted.retired_changes == post.preparer.retired_changes

    # "easy" fails from now on (samples generated before the rollout saw it retire): its
    # last 4 samples are wrong, and it stays retired, with no change written
    for seq in range(20, 21):
        key = keys.rollout(0, 0, seq)
        table = npr_shard(seq, easy_right=False)
        scored, ready = post.process(table)
        post.write(key, table, scored, ready, post.preparer.record(key, ready))
    assert tracker.pass_rate("easy") == 0.0 and tracker.retired() == {"easy"}
    assert store.list(keys.retired_prefix()) == changes
    assert early_reader.refresh() == {"easy"} and RetiredPrompts(store, keys).refresh() == {"easy"}


def test_a_retirement_stays_when_the_shard_that_brought_it_is_quarantined_and_prepare_restarts(
        tmp_path):
    """A restarted preparer replays the ready shards merged since its snapshot, skipping
    those the learner quarantined since; a retirement one of them brought was published
    already, and must not be taken back by the next full set."""
    from shardrl.stages.rollout import RetiredPrompts
    from shardrl.store.shards import quarantine

    npr = "algo.filters.no_positive_resampling"
    opts = (f"{npr}.enabled=true", f"{npr}.window=4", f"{npr}.retire_at=0.75",
            f"{npr}.min_samples=4")
    ctx = context(tmp_path, "rollout", *opts)
    store, keys = ctx.store, ctx.keys

    def shards(post, seqs, easy_right):
        for seq in seqs:
            key = keys.rollout(0, 0, seq)
            table = npr_shard(seq, easy_right=easy_right)
            scored, ready = post.process(table)
            post.write(key, table, scored, ready, post.preparer.record(key, ready))

    shards(InlinePostprocess(ctx), [0], easy_right=True)  # "easy" 4 of 4 right: retired
    assert RetiredPrompts(store, keys).refresh() == {"easy"}
    quarantine(store, keys.ready_for(keys.rollout(0, 0, 0)), "learn", ValueError("unreadable"))
    restarted = InlinePostprocess(context(tmp_path, "rollout", *opts))
    assert restarted.preparer.tracker.retired() == {"easy"}
    shards(restarted, range(1, 9), easy_right=False)  # through the next snapshot's full set
    assert store.get_json(store.list(keys.retired_prefix())[-1])["full"]
    assert RetiredPrompts(store, keys).refresh() == {"easy"}

    # a ready shard of the replay that does not read: left out, with a warning, instead of
    # failing every restart until the learner quarantines it
    state = store.get_json(restarted.preparer.state_key)
    store.put_bytes(state["replay"][-1], b"not parquet")
    again = InlinePostprocess(context(tmp_path, "rollout", *opts))
    assert again.preparer.tracker.retired() == {"easy"}


def test_a_retired_change_written_before_a_crash_is_never_written_over(tmp_path):
    """A crash between a retired change and the state that counts it: the restarted
    preparer knows that change's prompts from the store, so merging its shard again retires
    nothing new, and the next change must still be numbered past it."""
    from shardrl.stages.rollout import RetiredPrompts

    npr = "algo.filters.no_positive_resampling"
    opts = (f"{npr}.enabled=true", f"{npr}.window=4", f"{npr}.retire_at=0.75",
            f"{npr}.min_samples=4")
    ctx = context(tmp_path, "prepare", *opts)
    store, keys = ctx.store, ctx.keys
    post = InlinePostprocess(context(tmp_path / "other", "rollout", *opts))

    def ready(seq: int, solved: str) -> tuple[str, pa.Table]:
        table = npr_shard(seq, easy_right=True)
        table = table.set_column(0, "prompt_id", pa.array(
            [solved if p == "easy" else p for p in table.column("prompt_id").to_pylist()]))
        key = keys.rollout(0, 0, seq)
        out = post.process(table)[1]
        write_shard(store, keys.ready_for(key), out, READY)
        return key, out

    key, out = ready(0, "a")
    n, change = Preparer(ctx).record(key, out).retired
    change.write(store, keys.retired_change(n))  # ... and the process dies before its state
    reader = RetiredPrompts(store, keys)
    assert reader.refresh() == {"a"}
    restarted = Preparer(context(tmp_path, "prepare", *opts))
    restarted.recover(0, 0)
    restarted.merged(*ready(1, "b"))
    assert [store.get_json(k)["add"] for k in store.list(keys.retired_prefix())] == [["a"], ["b"]]
    assert reader.refresh() == RetiredPrompts(store, keys).refresh() == {"a", "b"}


def test_a_recovery_window_longer_than_the_names_remembered_merges_nothing_twice(
        tmp_path, monkeypatch):
    """Ready shards merged so long ago that the preparer's list of recent names dropped
    them are not merged again when a restarted preparer recovers a window that still holds
    them (a large batch, or a slow worker's open version): their outcomes and rewards used
    to count twice."""
    monkeypatch.setattr("shardrl.stages.prepare.RECENT", 2)
    ctx = context(tmp_path, "rollout", "algo.shaping.normalize=true")
    store, keys, post = ctx.store, ctx.keys, InlinePostprocess(ctx)
    for seq in range(5):  # worker 0's shards 0-4, all in version 3
        key = keys.rollout(3, 0, seq)
        table = rollout_table(3, 0, seq)
        scored, ready = post.process(table)
        post.write(key, table, scored, ready, post.preparer.record(key, ready))
    assert post.preparer.recent == ["w00-000003.parquet", "w00-000004.parquet"]
    assert post.preparer.forgotten == {0: 2}
    merged = post.preparer.moments.state_dict()["count"]
    assert merged == 40
    # one more ready shard written, and the worker killed before its state was saved
    key = keys.rollout(3, 0, 5)
    scored, ready = post.process(rollout_table(3, 0, 5))
    write_shard(store, keys.ready_for(key), ready, READY)
    restarted = InlinePostprocess(ctx)
    assert restarted.preparer.forgotten == {0: 2}
    restarted.recover(last_version=3, newest=3)
    assert restarted.preparer.moments.state_dict()["count"] == merged + 8  # shard 5 alone
