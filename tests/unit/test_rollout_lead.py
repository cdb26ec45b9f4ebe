"""A rollout worker's lead counted from the learner's take, and the standby workers' rule."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardrl.config import ConfigError, load_config
from shardrl.config.stages import StandbyConfig
from shardrl.stages import channel as channel_module
from shardrl.stages.channel import ENV as CHANNEL_ENV
from shardrl.stages.channel import MAX_BYTES, Channel
from shardrl.stages.context import StageContext
from shardrl.stages.rollout import Flow, Standby
from shardrl.store import LocalStore
from shardrl.store.records import Progress, Taken, WorkerState

ARRANGED = ["rollout.lead_counted_at=take", "rollout.standby.workers=1"]
"""The demo's two workers (batch 16), the lead counted from the take, worker 1 standing by."""


def flow(tmp_path, worker: int, kept: int, overrides: list[str] = ()) -> tuple[Flow, StageContext]:
    """Worker `worker` of two (`ARRANGED`) that wrote `kept` kept groups, of 4 times as many."""
    cfg = load_config("demo", [*ARRANGED, "learner.total_steps=1000", *overrides])
    ctx = StageContext(stage="rollout", cfg=cfg, run_id="r1", store=LocalStore(tmp_path),
                       worker=worker, workers=2)
    return Flow(ctx, WorkerState(groups_written=4 * kept, kept_written=kept), exact=True), ctx


def committed(worker: int, kept: int) -> Progress:
    return Progress(version=5, groups_by_worker={worker: 4 * kept},
                    kept_groups_by_worker={worker: kept})


def took(ctx: StageContext, worker: int, kept: int, version: int = 5, **clock: float) -> None:
    Taken(version=version, groups_by_worker={worker: 4 * kept},
          kept_groups_by_worker={worker: kept}, **clock).write(ctx.store, ctx.keys.taken())


def test_the_lead_counts_from_the_take(tmp_path):
    # worker 0 generates throughout: its share is the whole batch of 16 kept groups, and it
    # may be one step (max_backlog_steps 1) of them ahead of the step being trained
    f, ctx = flow(tmp_path, 0, kept=40)
    assert f.share == 16 and f.at_take and f.standby is None
    progress = committed(0, 16)
    # no take recorded yet: counted from the commit, 40 - 16 = 24 ahead, 8 over its 16
    assert f.full(progress) and f.room(progress) == 16 - 24
    assert f.why == "24 kept groups not yet taken (cap 16)"  # the commit's count, as a take
    # the learner took 32 into the step it trains: 8 ahead, room for 8 more
    took(ctx, 0, 32)
    assert not f.full(progress) and f.room(progress) == 8
    # 8 kept groups at 4 a shard (the demo's 16 prompts, 1 in 4 kept so far): 2 shards
    assert f.batch(progress) == 2
    # taken at version 6, whose commit has not landed (progress is at 5): wait for it, so as
    # to generate with version 6 rather than 5
    took(ctx, 0, 32, version=6)
    assert f.full(progress) and f.room(progress) == 8
    assert f.why == "waiting for version 6, which the learner took at"
    assert not f.full(committed(0, 16).model_copy(update={"version": 6}))
    # a take older than the commit (a restarted learner's) counts no further than the commit
    took(ctx, 0, 10)
    assert f.full(progress) and f.room(progress) == -8
    assert f.why == "24 kept groups not yet taken (cap 16)"


def test_the_lead_counts_from_the_commit_when_told_or_synchronous(tmp_path):
    # counted from the commit the step being trained counts too: a cap of 2 x 16
    f, ctx = flow(tmp_path, 0, kept=40, overrides=["rollout.lead_counted_at=commit"])
    took(ctx, 0, 40)
    assert not f.at_take and f.room(committed(0, 16)) == 32 - 24
    assert f.full(committed(0, 0)) and f.why == "40 kept groups not yet committed (cap 32)"
    # k = 0 is synchronous: one step's share, counted from the commit, whatever was taken
    f, ctx = flow(tmp_path, 0, kept=40, overrides=["learner.max_staleness=0"])
    took(ctx, 0, 40)
    assert f.at_take and f.room(committed(0, 16)) == 16 - 24
    assert f.full(committed(0, 16)) and not f.full(committed(0, 30))


def test_a_standby_worker_helps_with_the_first_batch_then_waits_to_be_called(tmp_path):
    f, ctx = flow(tmp_path, 1, kept=0)
    assert f.standby is not None and f.share == 8  # the batch split among both workers
    progress = Progress()
    assert not f.full(progress)  # no step yet: the learner waits for its first batch
    took(ctx, 0, 16, version=0, stepping_s=0.0, elapsed_s=1.0)
    assert f.full(progress)  # one record says nothing about waiting yet: stand by
    assert f.why == "standing by"
    took(ctx, 0, 32, version=0, stepping_s=0.1, elapsed_s=2.0)  # 90% of the last second waiting
    assert not f.full(progress) and f.room(progress) == 8
    # the other worker keeps its whole share and never stands by
    other, _ = flow(tmp_path, 0, kept=0)
    assert other.standby is None and not other.full(progress)
    # a --once round (Kubeflow) uses every worker
    once = StageContext(stage="rollout", cfg=load_config("demo", ARRANGED), run_id="r1",
                        store=LocalStore(tmp_path), worker=1, workers=2, once=True)
    assert Flow(once, WorkerState(), exact=True).standby is None


def test_standby_rule_by_hand(caplog):
    rule = Standby(StandbyConfig(workers=1, start=0.5, stop=0.1, window_steps=2))

    def step(stepping_s, elapsed_s, learner="a"):
        return rule.called(Taken(stepping_s=stepping_s, elapsed_s=elapsed_s, learner=learner),
                           logging.getLogger("t"))

    assert rule.called(None)  # before the learner's first step
    assert not step(0.0, 1.0)  # one mark: no share yet, off
    assert not step(0.5, 2.0)  # 1 - 0.5 / 1 = 0.5 waiting: not above start
    assert rule.waiting_share() == pytest.approx(0.5)
    with caplog.at_level(logging.INFO):
        assert step(0.8, 3.0)  # window (0, 1) -> (0.8, 3): 1 - 0.8 / 2 = 0.6 > 0.5: on
    assert "generating: the learner waited for data 60% of its last 2 steps" in caplog.text
    assert step(1.7, 4.0)  # (0.5, 2) -> (1.7, 4): 1 - 1.2 / 2 = 0.4, above stop: stays on
    assert step(1.7, 4.0)  # the same record read again adds no mark
    assert len(rule.marks) == 3
    assert not step(2.6, 5.0)  # (0.8, 3) -> (2.6, 5): 1 - 1.8 / 2 = 0.1, not above stop: off
    # a restarted learner's clock starts again from 0: the old marks are dropped
    assert not step(0.1, 0.5) and list(rule.marks) == [(0.1, 0.5)]
    assert not step(0.9, 1.5) and len(rule.marks) == 2  # 1 - 0.8 / 1 = 0.2: off
    # one that restarted and ran past the old clock before its first record: told by its id
    assert not step(0.3, 9.0, learner="b") and list(rule.marks) == [(0.3, 9.0)]


def test_standby_settings_are_checked_and_one_worker_always_generates(tmp_path):
    with pytest.raises(ConfigError, match="must not exceed"):
        load_config("demo", ["rollout.standby.stop=0.6"])
    cfg = load_config("demo", [*ARRANGED, "rollout.workers=1"])  # one standby worker of one
    ctx = StageContext(stage="rollout", cfg=cfg, run_id="r1", store=LocalStore(tmp_path))
    only = Flow(ctx, WorkerState(), exact=True)
    assert only.standby is None and only.share == 16


def test_the_weights_channel_holds_the_newest_versions_until_cleared(tmp_path):
    channel = Channel(tmp_path)
    assert channel.latest() is None and channel.load(1) is None
    for v in (1, 2, 3):
        assert channel.publish(v, {"w": torch.full((2, 3), float(v)), "b": torch.zeros(3)})
    assert channel.latest() == 3
    assert torch.equal(channel.load(3)["w"], torch.full((2, 3), 3.0))
    assert channel.load(2) is not None and channel.load(1) is None  # KEEP = 2 versions
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "v00000002.safetensors", "v00000003.safetensors", "version"]  # no temporary left
    # larger than MAX_BYTES: not written, the store alone hands it over
    big = {"w": torch.zeros(MAX_BYTES // 4 + 1)}
    assert not channel.publish(4, big) and channel.latest() == 3
    channel.clear()  # a learner that starts: nothing an earlier one made is handed on
    assert channel.latest() is None and list(tmp_path.iterdir()) == []


def test_a_worker_takes_only_a_channel_version_newer_than_the_store_and_its_own(tmp_path):
    """`PolicyEngine.take` on hand-set versions: the weights it loads are the channel's, and
    they are not kept as the base of the store's deltas (a restarted learner may make that
    version again, differently)."""
    from shardrl.engines.hf import HFEngine
    from shardrl.models.tiny import tiny_lm
    from shardrl.stages.engine import PolicyEngine
    from shardrl.stages.policy import PolicyWeights

    model = tiny_lm(vocab_size=12, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16,
                    max_position_embeddings=16, seed=0)
    engine = PolicyEngine.__new__(PolicyEngine)  # the parts `take` uses, without a store
    engine.engine = HFEngine(model, eos_token_id=2, pad_token_id=0, version=2)
    engine.weights, engine.from_channel = PolicyWeights(), 0
    engine.weights.state, engine.weights.version = {"w": torch.zeros(1)}, 2
    channel = Channel(tmp_path)
    assert not engine.take(channel, committed=2)  # an empty channel
    new = {k: torch.full_like(t, 0.5) for k, t in model.state_dict().items()}
    channel.publish(3, new)
    assert not engine.take(channel, committed=3)  # the store has it too: no shortcut
    assert engine.take(channel, committed=2)
    assert engine.version == 3 and engine.from_channel == 1
    assert torch.equal(model.model.embed_tokens.weight, new["model.embed_tokens.weight"])
    assert engine.weights.state == {} and engine.weights.version is None
    assert not engine.take(channel, committed=2)  # already on it
    engine.engine.version = 5
    assert not engine.take(channel, committed=4) and engine.version == 5  # never back


def test_a_full_channel_is_skipped_and_leaves_nothing_half_written(tmp_path, monkeypatch,
                                                                  caplog):
    """Shared memory full: the learner goes on (the workers wait for the commit) and the
    folder still names the last version it holds; a learner killed mid-write leaves a
    temporary file, which clearing removes."""
    channel = Channel(tmp_path)
    assert channel.publish(1, {"w": torch.ones(2)})
    real = Path.write_bytes

    def full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="shardrl.stages.channel"):
        assert not channel.publish(2, {"w": torch.zeros(2)})
        assert not channel.publish(3, {"w": torch.zeros(2)})
    monkeypatch.undo()
    assert "version 2 not written (" in caplog.text and "No space left" in caplog.text
    assert "version 3" not in caplog.text and channel.refused == 2  # said once
    assert channel.latest() == 1 and torch.equal(channel.load(1)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001.safetensors", "version"]
    (tmp_path / ".v00000002.safetensors.4242.tmp").write_bytes(b"half")
    channel.clear()
    assert list(tmp_path.iterdir()) == []


def test_channel_folders_of_runners_that_are_gone_are_swept(tmp_path):
    """A runner killed before it removed its folder: the next one to make a folder in the
    same place removes it. A folder whose runner still holds its lock stays (in another
    process namespace too: the lock, not a process id, tells), and so do other folders and
    a folder too new to have its lock yet."""
    ours, lock = channel_module.make(tmp_path)
    assert ours.parent == tmp_path and ours.name.startswith("shardrl-weights-")
    make = ("import sys, time; from shardrl.stages import channel; "
            "folder, _ = channel.make(sys.argv[1]); print(folder, flush=True); "
            "time.sleep(float(sys.argv[2]))")
    live = subprocess.Popen([sys.executable, "-c", make, str(tmp_path), "60"],
                            stdout=subprocess.PIPE, text=True)
    try:
        running = Path(live.stdout.readline().strip())
        gone = subprocess.run([sys.executable, "-c", make, str(tmp_path), "0"],
                              capture_output=True, text=True, check=True)
        stale = Path(gone.stdout.strip())
        (stale / "v00000003.safetensors").write_bytes(b"weights")
        other = tmp_path / "notes"
        other.mkdir()
        unlocked = tmp_path / "shardrl-weights-new"
        unlocked.mkdir()
        old = tmp_path / "shardrl-weights-old"
        old.mkdir()
        os.utime(old, (0, 0))
        assert sorted(channel_module.sweep(tmp_path)) == sorted([stale, old])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [ours.name, running.name, other.name, unlocked.name])
    finally:
        live.kill()
        live.wait()
    assert channel_module.sweep(tmp_path) == [running]  # its runner is gone now
    os.close(lock)
    assert channel_module.sweep(tmp_path) == [ours]


def test_a_run_without_room_for_the_channel_goes_on_without_it(monkeypatch, capsys):
    from shardrl.orchestrate import local

    def refuse(parent=None):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(channel_module, "make", refuse)
    assert local.open_channel() == (None, None)
    assert capsys.readouterr().err == (
        "pipeline.local.weights_channel: no folder for it ([Errno 30] Read-only file system); "
        "new weights reach the rollout workers through the store alone\n")


def test_the_runner_empties_the_channel_when_the_learner_fails(tmp_path, monkeypatch):
    """Versions a failed learner named may never be committed: the runner removes them when
    it sees the exit, before the backoff, not when the restarted learner gets to it."""
    from shardrl.orchestrate import local

    cfg = load_config("demo", ["pipeline.local.weights_channel=true", "pipeline.max_restarts=1"])
    run = local.LocalRun(cfg, "r1", str(tmp_path), LocalStore(str(tmp_path)), tmp_path,
                         tmp_path / "config.yaml")
    run.channel = tmp_path / "channel"
    run.channel.mkdir()
    Channel(run.channel).publish(5, {"w": torch.ones(1)})
    exits = iter([1])

    class Failed:
        def poll(self):
            return next(exits, None)

    run.procs = [local.Proc("learn", 0, Failed(), tmp_path / "learn.log")]
    seen = []

    class Monitor:
        def say(self, text):
            seen.append((text, Channel(run.channel).latest()))
            raise KeyboardInterrupt  # stop the loop at its first report

        def tick(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        local.supervise(run, Monitor(), lambda: False)
    assert seen == [("learn exited with 1; restarting in 1 s (1/1)", None)]
    assert list(run.channel.iterdir()) == []


def test_a_worker_waits_for_the_version_the_learner_took_at(tmp_path, monkeypatch):
    f, ctx = flow(tmp_path / "store", 0, kept=40)
    progress = committed(0, 16)  # version 5 committed
    took(ctx, 0, 32, version=6)  # the step that publishes 7 took its batch at 6
    assert f.full(progress)  # 6 is not in the store yet, and there is no channel
    (tmp_path / "channel").mkdir()
    f.channel = Channel(tmp_path / "channel")
    f.channel.publish(6, {"w": torch.zeros(1)})
    assert f.newest(progress) == 6 and not f.full(progress)
    monkeypatch.setenv(CHANNEL_ENV, str(tmp_path / "channel"))
    assert Channel.from_env().path == tmp_path / "channel"
    monkeypatch.setenv(CHANNEL_ENV, str(tmp_path / "gone"))
    assert Channel.from_env() is None
