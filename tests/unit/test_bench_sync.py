"""bench/sync_baseline.py: its prepare step gives what the prepare stage gives, it forms
batches as the learner does, and it refuses configs it does not reproduce."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from bench.sync_baseline import (
    PausableClock,
    SyncTrainer,
    check_supported,
    cpu_per_step,
    run_sync,
)

from shardrl.algo import PassRateTracker, RunningMoments
from shardrl.config import load_config
from shardrl.models.io import save_model
from shardrl.models.tiny import build_tiny_model, train_tokenizer
from shardrl.stages.prepare import Preparer
from shardrl.store import LocalStore, RunKeys
from shardrl.store.schemas import SCORED

# three groups of four: one with signal, one all correct (zero variance), one with signal
# and a row whose reward is not finite
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, float("nan")]


def scored_table(rewards: list[float]) -> pa.Table:
    n = len(rewards)
    groups = [f"w00-000000-{i // 4:03d}" for i in range(n)]
    cols = {
        "prompt_id": [f"p{i // 4}" for i in range(n)], "group_id": groups,
        "sample_idx": [i % 4 for i in range(n)], "policy_version": [0] * n, "worker": [0] * n,
        "prompt_text": ["ab="] * n, "prompt_token_ids": [[1, 2, 3]] * n,
        "response_token_ids": [[4, 5]] * n, "behavior_logprobs": [[-0.5, -0.25]] * n,
        "finish_reason": ["stop"] * n, "response_text": ["bc"] * n, "answer": ["bc"] * n,
        "category": ["cipher"] * n, "created_at": [0.0] * n,
        "reward_verifier": rewards, "reward_model": [None] * n, "reward_rm": rewards,
        "correct": [r == 1.0 for r in rewards], "reward_error": [None] * n,
        "ref_logprobs": [None] * n,
    }
    return pa.table(cols, schema=SCORED)


def sync_trainer(cfg) -> SyncTrainer:
    """A trainer with only what prepare and batch use (no model)."""
    npr = cfg.algo.filters.no_positive_resampling
    trainer = object.__new__(SyncTrainer)
    trainer.cfg, trainer.moments = cfg, RunningMoments()
    trainer.tracker = PassRateTracker(window=npr.window, retire_at=npr.retire_at,
                                      min_samples=npr.min_samples)
    trainer.seconds = {"generate": 0.0, "score_prepare": 0.0, "update": 0.0}
    trainer.cpu_seconds = {"generate": 0.0, "tables": 0.0, "score_prepare": 0.0, "update": 0.0}
    trainer.groups = trainer.kept_groups = 0
    return trainer


@pytest.mark.parametrize("overrides", [[], ["algo.shaping.normalize=true"],
                                       ["algo.advantages.norm=prompt"]])
def test_prepare_matches_the_prepare_stage(tmp_path, overrides):
    cfg = load_config("demo", overrides)
    ctx = SimpleNamespace(cfg=cfg, keys=RunKeys("sync"), store=LocalStore(tmp_path),
                          metrics=SimpleNamespace(log=lambda step, values: None))
    stage, ours = Preparer(ctx), sync_trainer(cfg)
    for shard in (REWARDS, REWARDS[4:] + REWARDS[:4]):  # two shards: running moments move on
        want = stage.prepare(scored_table(shard))
        got = ours.prepare(scored_table(shard))
        for name in ("reward_total", "advantage"):
            np.testing.assert_allclose(got.column(name).to_numpy(),
                                       want.column(name).to_numpy(), rtol=0, atol=0)
        for name in ("keep", "filter_reason"):
            assert got.column(name).to_pylist() == want.column(name).to_pylist()
    keep = got.column("keep").to_pylist()
    assert sum(keep) == 4 + 3  # a whole group with signal; the other less its NaN row


def test_batch_generates_until_the_learner_would_step(monkeypatch):
    cfg = load_config("demo", ["rollout.prompts_per_shard=8"])  # batch_prompts 16
    trainer = sync_trainer(cfg)
    cpu = iter(range(100))  # every reading of the process CPU clock is 1 s after the last
    monkeypatch.setattr("bench.sync_baseline.time.process_time", lambda: float(next(cpu)))
    kept_per_shard = iter([8, 6, 3, 8])
    calls: list[int] = []

    def generate(shards, clock, events):
        calls.append(shards)
        tables = []
        for _ in range(shards):
            kept = next(kept_per_shard)
            tables.append(pa.table({"group_id": [f"g{len(calls)}-{len(tables)}-{i}"
                                                 for i in range(8)],
                                    "keep": [i < kept for i in range(8)]}))
        return tables

    trainer.generate = generate
    trainer.score = trainer.prepare = lambda table: table
    table = trainer.batch(None, [])
    # 2 shards for 16 groups give 14 kept; 1 more shard for the last 2 gives 17: stop there
    assert calls == [2, 1]
    assert len(table) == 24 and sum(table.column("keep").to_pylist()) == 17
    # scoring and prepare after each of the 2 calls: 1 s of the fake CPU clock each
    assert trainer.cpu_seconds == {"generate": 0.0, "tables": 0.0, "score_prepare": 2.0,
                                   "update": 0.0}


def test_generation_cpu_is_split_into_the_sampling_call_and_the_tables(monkeypatch):
    trainer = sync_trainer(load_config("demo"))
    cpu = iter([10.0, 15.0, 20.0, 21.0])
    monkeypatch.setattr("bench.sync_baseline.time.process_time", lambda: next(cpu))

    def sample(shards, clock, events):  # its sampling call took 3 of the 5 CPU seconds
        trainer.cpu_seconds["generate"] += 3.0
        return ["table"] * shards

    trainer._generate = sample
    assert trainer.generate(2, None, []) == ["table", "table"]
    assert trainer.cpu_seconds["generate"] == 3.0 and trainer.cpu_seconds["tables"] == 2.0

    def fail(shards, clock, events):  # an error still counts the CPU spent before it
        raise RuntimeError("no prompt fits")

    trainer._generate = fail
    with pytest.raises(RuntimeError):
        trainer.generate(1, None, [])
    assert trainer.cpu_seconds["tables"] == 3.0


def test_cpu_per_step_splits_the_phases():
    got = cpu_per_step({"generate": 2.0, "score_prepare": 0.5, "update": 1.5}, 10)
    assert got == pytest.approx({"total": 0.4, "generate": 0.2, "score_prepare": 0.05,
                                 "update": 0.15})
    assert cpu_per_step({"generate": 1.0}, 0) is None


def test_batch_sizes_its_calls_by_the_keep_rate_seen():
    cfg = load_config("demo", ["rollout.prompts_per_shard=8"])  # batch_prompts 16
    trainer = sync_trainer(cfg)
    calls: list[int] = []

    def generate(shards, clock, events):  # 2 of each shard's 8 groups are kept
        calls.append(shards)
        return [pa.table({"group_id": [f"g{len(calls)}-{s}-{i}" for i in range(8)],
                          "keep": [i < 2 for i in range(8)]}) for s in range(shards)]

    trainer.generate = generate
    trainer.score = trainer.prepare = lambda table: table
    first = trainer.batch(None, [])
    # no history: 2 shards (at most 8 kept each); then 4 of 16 groups kept (rate 1/4), so
    # the 12 missing kept groups need 12 / (8 x 1/4) = 6 shards in one call
    assert calls == [2, 6]
    assert sum(first.column("keep").to_pylist()) == 16
    trainer.batch(None, [])
    # the next step asks for all 16 / 2 = 8 shards at once
    assert calls == [2, 6, 8]
    assert (trainer.groups, trainer.kept_groups) == (128, 32)


def test_unsupported_configs_are_refused():
    cfg = load_config("demo", [])
    check_supported(cfg)  # the demo is covered
    kl = SimpleNamespace(algo=SimpleNamespace(
        kl=SimpleNamespace(placement="loss"), advantages=cfg.algo.advantages, critic=None),
        rollout=cfg.rollout, learner=cfg.learner)
    with pytest.raises(ValueError, match="kl.placement"):
        check_supported(kl)


def test_lora_is_refused():
    with pytest.raises(ValueError, match="learner.lora"):
        check_supported(load_config("demo", ["learner.lora={r: 4, alpha: 8}"]))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_policy_trains_with_the_learners_activation_checkpointing(tmp_path, checkpointing):
    # the learner turns it on in `Learner._start`; a baseline that did not would skip the
    # recomputation (and share prompts, which the learner then cannot): less work per step
    tokenizer = train_tokenizer(["abcdefghij=+"], tmp_path / "tok")
    folder = tmp_path / "policy"
    save_model(build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                intermediate_size=16, max_position_embeddings=32, seed=0),
               tokenizer, folder)
    cfg = load_config("demo", [f"learner.activation_checkpointing={str(checkpointing).lower()}"])
    trainer = SyncTrainer(cfg, folder, threads=1)
    assert trainer.model.is_activation_checkpointing is checkpointing


def test_clock_pauses_while_evaluating():
    clock = PausableClock(time.time() - 10.0)
    assert clock.paused(lambda: time.sleep(0.05) or 0.5) == 0.5
    assert clock.paused_s >= 0.05
    assert clock.now() == pytest.approx(10.0, abs=0.05)


class FakeTrainer:
    """What `run_sync` uses of a `SyncTrainer`: a one-weight model whose weight is the
    version, each batch a few milliseconds of clock."""

    def __init__(self, cfg, snapshot, threads, loaded=None) -> None:
        self.loaded = loaded
        self.model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(self.model.weight)
        self.tokenizer = self.task = None
        self.version, self.threads = 0, 1
        self.counts = {"generated": 0}
        self.seconds, self.cpu_seconds = {"update": 0.0}, {"update": 0.0}
        self.step_update_cpu_s, self.step_rows = [], []

    def batch(self, clock, events):
        time.sleep(0.004)
        self.counts["generated"] += 8
        events.append((clock.now(), 8))
        return None

    def update(self, table) -> bool:
        self.version += 1
        with torch.no_grad():
            self.model.weight.fill_(float(self.version))
        return True


@pytest.mark.parametrize("after", [False, True])
def test_evaluating_after_the_budget_measures_each_points_weights(monkeypatch, after):
    calls = []  # (the weight evaluated, the versions trained so far) at each evaluation

    def heldout_pass(model, tokenizer, cfg, task):
        calls.append((model.weight.item(), trainers[0].version))
        return model.weight.item() / 1000.0

    trainers = []
    monkeypatch.setattr("bench.sync_baseline.SyncTrainer",
                        lambda *a: trainers.append(FakeTrainer(*a)) or trainers[-1])
    monkeypatch.setattr("bench.sync_baseline.before_clock", lambda cfg: None)
    monkeypatch.setattr("bench.sync_baseline.load_snapshot", lambda snapshot: None)
    monkeypatch.setattr("bench.demo_control.heldout_pass", heldout_pass)
    result = run_sync("demo", [], Path("unused"), budget=0.12, eval_points=6, eval_after=after)
    trainer = trainers[0]
    assert result["eval_when"] == ("after" if after else "during")
    assert len(result["curve"]) >= 5 and result["curve_versions"][0] == 0
    # every point's pass@1 is that of the weights it was taken at
    for (_, value), version in zip(result["curve"], result["curve_versions"], strict=True):
        assert value == version / 1000.0
    trained = [done for _, done in calls]
    if after:  # evaluated once training was over, not between its steps
        assert trained == [trainer.version] * len(calls)
        assert trainer.model.weight.item() == trainer.version  # the final weights restored
    else:
        assert trained == result["curve_versions"]


def test_evaluating_after_falls_back_to_in_place_past_the_memory_cap(monkeypatch):
    monkeypatch.setattr("bench.sync_baseline.SyncTrainer", FakeTrainer)
    monkeypatch.setattr("bench.sync_baseline.before_clock", lambda cfg: None)
    monkeypatch.setattr("bench.sync_baseline.load_snapshot", lambda snapshot: None)
    monkeypatch.setattr("bench.demo_control.heldout_pass", lambda *a: 0.5)
    monkeypatch.setattr("bench.sync_baseline.EVAL_AFTER_MAX_BYTES", 4 * 3)  # 3 copies of 4 B
    result = run_sync("demo", [], Path("unused"), budget=0.03, eval_points=6, eval_after=True)
    assert result["eval_when"] == "during"


def test_the_snapshot_loads_before_the_clock_starts(monkeypatch):
    """The loop's clock starts with its model loaded, as ShardRL's starts with policy v0
    loaded by its stages while the snapshot evaluates it."""
    trainers, loaded = [], object()

    def load_snapshot(snapshot):
        time.sleep(0.3)
        return loaded

    monkeypatch.setattr("bench.sync_baseline.SyncTrainer",
                        lambda *a: trainers.append(FakeTrainer(*a)) or trainers[-1])
    monkeypatch.setattr("bench.sync_baseline.before_clock", lambda cfg: None)
    monkeypatch.setattr("bench.sync_baseline.load_snapshot", load_snapshot)
    monkeypatch.setattr("bench.demo_control.heldout_pass", lambda *a: 0.5)
    result = run_sync("demo", [], Path("unused"), budget=0.03, eval_points=2)
    assert trainers[0].loaded is loaded  # the trainer got the model loaded before
    assert result["startup_seconds"] < 0.3  # the load's 0.3 s is not on the clock
