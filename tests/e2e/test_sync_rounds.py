"""`--once` rounds chain exactly, with zero-variance filtering on.

The synchronous pipeline starts a new learner process per round. Here the same rounds run
twice from one snapshot: once with a new learner each round (as the pipeline does), once with
one learner kept in memory across the rounds (a continuous run). With every round's optimizer
state checkpointed and reloaded, both publish the same weights at every version and end with
the same Adam state. Scoring and preparing run as stages, so a rollout round cannot count the
groups filtering will keep: each round's learner takes what the round brought, and a round
whose groups were all filtered publishes the previous weights unchanged as its version
instead of waiting for more, so every round makes one version.
"""

from __future__ import annotations

import logging
import shutil

import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load as st_load

from shardrl.learner_backends.base import STEP_KEY
from shardrl.models.delta import bits
from shardrl.orchestrate.accounting import account
from shardrl.stages.checkpoint import latest_checkpoint
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.stages.learn import Learner
from shardrl.stages.learn.ranks import BACKEND_STATE
from shardrl.stages.policy import fetch_weights
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import LedgerDelta, Progress
from shardrl.store.schemas import READY
from shardrl.store.shards import read_shard

from .rounds import one_thread, run_round, tiny_config

pytestmark = pytest.mark.slow

ROUNDS, B, G = 5, 2, 2
BASE = """\
extends: demo
name: rounds
task:
  source: {kind: builtin, heldout_size: 16}
"""
SETTINGS = ("model.sft.enabled=true", "rollout.workers=1", "rollout.postprocess=stages",
            f"rollout.group_size={G}", f"rollout.prompts_per_shard={B}",
            f"learner.batch_prompts={B}", f"learner.total_steps={ROUNDS}",
            "learner.ckpt_every=100", "learner.warmup_steps=1", "learner.max_staleness=0",
            "eval.every=2", "algo.filters.zero_variance=true")
"""Groups of two samples, so filtering removes about half of them; a checkpoint interval
longer than the run, so only the `--once` rule checkpoints."""


def commits(store: LocalStore, keys: RunKeys) -> list[tuple[bool, int]]:
    """(stepped, prompt groups kept by filtering among its admitted shards) of each commit."""
    out = []
    for key in sorted(store.list(keys.ledger_prefix())):
        delta = LedgerDelta.read(store, key)
        tables = [read_shard(store, e.key, READY) for e in delta.shards if e.outcome == "admitted"]
        out.append((delta.stepped, sum(len(pc.unique(t.filter(t.column("keep")).column("group_id")))
                                       for t in tables)))
    return out


def test_once_rounds_carry_the_optimizer_state_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, base=BASE, overrides=SETTINGS)
    run_id = "sync"
    keys = RunKeys(run_id)
    chained, continuous = LocalStore(tmp_path / "chained"), LocalStore(tmp_path / "continuous")
    with one_thread():
        run_round(chained, cfg, run_id, "snapshot")  # SFT: rewards differ within groups
        shutil.copytree(tmp_path / "chained", tmp_path / "continuous")
        ctx = StageContext(stage="learn", cfg=cfg, run_id=run_id, store=continuous, once=True,
                           log=logging.getLogger("rounds.learn"))
        ctx.metrics = MetricsSink(continuous, keys, "learn", 0)
        learner = Learner(ctx)  # one learner, kept across the rounds
        for _ in range(ROUNDS):
            for stage in ("rollout", "score", "prepare"):
                run_round(chained, cfg, run_id, stage)
                run_round(continuous, cfg, run_id, stage)
            run_round(chained, cfg, run_id, "learn")  # a new learner each round
            assert learner._lead() == 0
            learner.writer.wait()
        learner.close_writes()

    # every round committed what it brought, once: none waited for a full batch of kept
    # groups. Every round made one version; a round whose groups were all filtered made it
    # without an update (its weights are the previous version's), the others stepped, on
    # fewer than B kept groups if that is what the round brought.
    made = commits(chained, keys)
    assert made == commits(continuous, keys)
    assert len(made) == ROUNDS and all(stepped for stepped, _ in made), made
    steps = Progress.read(chained, keys.progress()).version
    assert steps == ROUNDS
    updates = sum(kept > 0 for _, kept in made)
    assert updates >= 2, made  # state to carry over
    for version, (_, kept) in enumerate(made, start=1):
        if kept == 0:
            before, now = fetch_weights(chained, keys, version - 1), fetch_weights(chained, keys,
                                                                                   version)
            assert all(torch.equal(before[n], now[n]) for n in now), version
    acc = account(chained, keys)
    assert acc.balanced and acc.filtered > 0, acc.line()
    # the same weights at every version: each round's learner resumed the optimizer exactly
    for version in range(1, steps + 1):
        a, b = fetch_weights(chained, keys, version), fetch_weights(continuous, keys, version)
        assert all(torch.equal(a[name], b[name]) for name in a), version
    assert latest_checkpoint(chained, keys) == steps
    state = st_load(chained.get_bytes(keys.learner_file(steps, f"{BACKEND_STATE}.safetensors")))
    live = learner.backend.state_dict()
    assert state.keys() == live.keys()
    assert all(torch.equal(state[name], live[name]) for name in state)
    assert float(live[STEP_KEY]) == updates  # Adam's step count: the rounds that updated


def test_a_round_whose_groups_are_all_filtered_still_makes_its_version(tmp_path, monkeypatch):
    """An untrained model answers every prompt wrong: every group has equal rewards and is
    filtered. Each round still publishes one version (the weights unchanged), so the run
    reaches total_steps and writes DONE.json instead of ending short."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, base=BASE, overrides=(
        *SETTINGS[1:], "model.sft.enabled=false", "learner.total_steps=2"))
    store, keys = LocalStore(tmp_path / "store"), RunKeys("filtered")
    with one_thread():
        run_round(store, cfg, "filtered", "snapshot")
        for _ in range(2):
            for stage in ("rollout", "score", "prepare", "learn"):
                run_round(store, cfg, "filtered", stage)
    made = commits(store, keys)
    assert made == [(True, 0), (True, 0)]
    progress = Progress.read(store, keys.progress())
    assert progress.version == 2 and progress.counts["unchanged_versions"] == 2
    assert progress.counts["consumed"] == 0 and progress.counts["filtered"] > 0
    v0, v2 = fetch_weights(store, keys, 0), fetch_weights(store, keys, 2)
    assert all(torch.equal(v0[n], v2[n]) for n in v2)
    assert store.exists(keys.done())
    assert account(store, keys).balanced


class WholeReads(LocalStore):
    """A folder store that records the keys read whole."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.whole: list[str] = []

    def get_bytes(self, key: str) -> bytes:
        self.whole.append(key)
        return super().get_bytes(key)


def test_a_learner_stopped_after_its_checkpoint_redoes_the_step_from_the_one_before(
        tmp_path, monkeypatch):
    """Full fine-tuning, `--once` rounds (a checkpoint at every version): a learner stopped
    after version 3's checkpoint but before its progress.json restarts at version 2 while
    LATEST names step 3. It takes the optimizer state of step 2 (pruning waits for the
    commit, so it is still there even with `keep_checkpoints: 1`), redoes the step into the
    same version 3 bit for bit, and leaves no checkpoint of the lost commit behind."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, overrides=(
        "rollout.workers=1", "learner.total_steps=4", "learner.lr=0.01",
        "learner.keep_checkpoints=1", "reward.overlong={buffer_tokens: 4}"))
    store, keys = WholeReads(tmp_path / "store"), RunKeys("redo")
    with one_thread():
        run_round(store, cfg, "redo", "snapshot")
        for _ in range(3):
            run_round(store, cfg, "redo", "rollout")
        run_round(store, cfg, "redo", "learn")
        run_round(store, cfg, "redo", "learn")
        at_two = store.get_bytes(keys.progress())
        step_two = store.get_bytes(keys.learner_file(2, f"{BACKEND_STATE}.safetensors"))
        run_round(store, cfg, "redo", "learn")
        first = fetch_weights(store, keys, 3)
        moments = store.get_bytes(keys.learner_file(3, f"{BACKEND_STATE}.safetensors"))
        # version 3's commit point never written, and its pruning never ran
        store.put_bytes(keys.progress(), at_two)
        store.put_bytes(keys.learner_file(2, f"{BACKEND_STATE}.safetensors"), step_two)
        assert latest_checkpoint(store, keys) == 3
        store.whole.clear()
        run_round(store, cfg, "redo", "learn")
    # the optimizer state came in a tensor at a time, never as one whole read
    assert not [k for k in store.whole if k.endswith(f"{BACKEND_STATE}.safetensors")]
    delta = LedgerDelta.read(store, sorted(store.list(keys.ledger_prefix()))[-1])
    assert delta.version == 3 and delta.restart.checkpoint == 2
    again = fetch_weights(store, keys, 3)
    assert first.keys() == again.keys()
    assert all(torch.equal(bits(first[k]), bits(again[k])) for k in first)
    assert store.get_bytes(keys.learner_file(3, f"{BACKEND_STATE}.safetensors")) == moments
    assert latest_checkpoint(store, keys) == 3
    assert not store.list(keys.learner_prefix(2))  # pruned once version 3 was committed
