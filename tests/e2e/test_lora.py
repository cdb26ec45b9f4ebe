"""A LoRA learner through the stages: each `--once` learn round is a new learner process
that resumes its adapters and their AdamW moments from the store, and the replay, one
learner running through, publishes the same merged weights bit for bit. KL is in the loss
against the initial policy, so the learner computes the reference with its adapters off
and the rollout worker scores inline (no score stage loads a reference)."""

from __future__ import annotations

import torch

from shardrl.cli import main as cli
from shardrl.models.delta import bits
from shardrl.stages.learn.replay import ledger_deltas
from shardrl.stages.policy import fetch_weights
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import ReplayCheck

from .conftest import learner_metric
from .rounds import one_thread, run_round, tiny_config

RUN = "lora"
LORA = "learner.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}"


def test_lora_rounds_resume_exactly_and_publish_merged_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, overrides=(
        LORA, "rollout.workers=1", "learner.total_steps=4", "learner.lr=0.01",
        "algo.kl.placement=loss",
        "reward.overlong={buffer_tokens: 4}"))
    assert cfg.learner_reference and cfg.inline_postprocess
    root = tmp_path / "store"
    store, keys = LocalStore(root), RunKeys(RUN)
    with one_thread():
        run_round(store, cfg, RUN, "snapshot")
        for _ in range(4):
            run_round(store, cfg, RUN, "rollout")
            run_round(store, cfg, RUN, "learn")
    deltas = ledger_deltas(store, keys)
    assert [d.version for d in deltas] == [1, 2, 3, 4]
    assert deltas[0].restart is None
    # every later round resumed from the checkpoint of the version before it
    assert [d.restart.checkpoint for d in deltas[1:]] == [1, 2, 3]
    v0, v4 = fetch_weights(store, keys, 0), fetch_weights(store, keys, 4)
    assert v4.keys() == v0.keys() and not any("lora" in k for k in v4)  # plain base names
    changed = {k for k in v0 if not torch.equal(bits(v0[k]), bits(v4[k]))}
    adapted = ("q_proj.weight", "v_proj.weight", "down_proj.weight")
    assert changed and all(k.endswith(adapted) for k in changed), changed  # the rest is frozen
    # the reference is the base: no KL before the adapters moved (B starts at zero), then some
    kl = learner_metric(root, RUN, "kl_mean")
    assert len(kl) == 4 and abs(kl[0]) < 1e-6 and kl[-1] > 1e-6, kl
    with one_thread():
        code = cli(["replay", RUN, "--store", str(root), "--verify", "--run-id", "again"])
    assert code == 0
    assert ReplayCheck.read(store, RunKeys("again").replay_check()).checked == [1, 2, 3, 4]
    capsys.readouterr()


def test_lora_learner_redoes_a_commit_lost_after_its_checkpoint(tmp_path, monkeypatch):
    """A crash after version 3's checkpoint but before its progress.json: the restarted
    learner is at version 2 while the newest checkpoint is 3's. It takes the adapters from
    version 2's checkpoint (kept: keep_checkpoints is at least 2) and redoes the step into
    the same version 3, bit for bit."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, overrides=(
        LORA, "rollout.workers=1", "learner.total_steps=4", "learner.lr=0.01",
        "reward.overlong={buffer_tokens: 4}"))
    store, keys = LocalStore(tmp_path / "store"), RunKeys(RUN)
    with one_thread():
        run_round(store, cfg, RUN, "snapshot")
        for _ in range(3):
            run_round(store, cfg, RUN, "rollout")
        run_round(store, cfg, RUN, "learn")
        run_round(store, cfg, RUN, "learn")
        at_two = store.get_bytes(keys.progress())
        run_round(store, cfg, RUN, "learn")
        first = fetch_weights(store, keys, 3)
        assert store.get_json(keys.latest_learner())["step"] == 3
        store.put_bytes(keys.progress(), at_two)  # version 3's commit point never written
        run_round(store, cfg, RUN, "learn")
    deltas = ledger_deltas(store, keys)
    assert deltas[-1].version == 3 and deltas[-1].restart.checkpoint == 2
    again = fetch_weights(store, keys, 3)
    assert first.keys() == again.keys()
    assert all(torch.equal(bits(first[k]), bits(again[k])) for k in first)
    assert not all(torch.equal(bits(first[k]), bits(fetch_weights(store, keys, 2)[k]))
                   for k in first)  # the step did change the weights
