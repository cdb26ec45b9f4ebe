"""The scalerl preset on the S3 store, and the ppo-rlhf preset with a tiny reward model."""

from __future__ import annotations

import os
import random

import pytest
import torch

from .conftest import TINY, learner_metric, run_cli, summary


def _preset(name: str) -> str:
    return TINY.replace("extends: demo", f"extends: {name}")


def test_scalerl_preset_on_s3(tmp_path, seaweed):
    seaweed.make_bucket("e2e-scalerl")
    cfg = tmp_path / "scalerl.yaml"
    # overlong shaping gives an untrained model's groups mixed rewards, so zero-variance
    # filtering (on in this preset) keeps some and the learner steps
    cfg.write_text(_preset("scalerl").replace("algo: {filters: {zero_variance: false}}", "")
                   + "reward: {overlong: {buffer_tokens: 4, penalty: 1.0}}\n"
                   + "tracking: {enabled: false}\n")
    env = {"AWS_ACCESS_KEY_ID": seaweed.access_key, "AWS_SECRET_ACCESS_KEY": seaweed.secret_key,
           "S3_ENDPOINT_URL": seaweed.endpoint}
    os.environ.update(env)
    try:
        res = run_cli(["run", str(cfg), "--store", "s3://e2e-scalerl/shardrl", "--run-id", "sc1",
                       "--no-progress"], tmp_path)
    finally:
        for key in env:
            os.environ.pop(key)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from shardrl.orchestrate.accounting import account
    from shardrl.store import RunKeys
    from shardrl.store.s3 import S3Store

    store = S3Store("e2e-scalerl", "shardrl", endpoint=seaweed.endpoint,
                    access_key=seaweed.access_key, secret_key=seaweed.secret_key)
    acc = account(store, RunKeys("sc1"))
    assert acc.balanced and acc.generated > 0
    assert acc.filtered > 0 or acc.consumed > 0
    assert store.exists(RunKeys("sc1").done())
    assert "holds" in res.stdout


def _train_reward_model(folder):
    """A tiny sequence classifier that prefers correct sums (Bradley-Terry on synthetic pairs)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from shardrl.models.tiny import train_tokenizer

    tok = train_tokenizer(["0123456789+="], folder)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                         num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config)
    opt = torch.optim.AdamW(rm.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(30):
        chosen, rejected = [], []
        for _ in range(16):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            chosen.append(f"{a}+{b}={a + b}")
            rejected.append(f"{a}+{b}={a + b + rng.randint(1, 9)}")
        enc = tok(chosen + rejected, return_tensors="pt", padding=True)
        scores = rm(**enc).logits.squeeze(-1)
        loss = -torch.nn.functional.logsigmoid(scores[:16] - scores[16:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.save_pretrained(folder)
    tok.save_pretrained(folder)


def test_ppo_rlhf_preset_with_reward_model_kl_and_critic(tmp_path):
    rm_dir = tmp_path / "rm"
    _train_reward_model(rm_dir)
    cfg = tmp_path / "rlhf.yaml"
    cfg.write_text(_preset("ppo-rlhf") + f"reward: {{reward_model: {{path: '{rm_dir}'}}}}\n"
                   + "tracking: {enabled: false}\n")
    store = tmp_path / "store"
    res = run_cli(["run", str(cfg), "--store", str(store), "--run-id", "rl1", "--no-progress"],
                  tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = summary(store, "rl1")
    assert s["accounting"]["balanced"] and s["done"]["steps"] == 6
    value_losses = learner_metric(store, "rl1", "value_loss")
    kl = learner_metric(store, "rl1", "kl_sum")
    betas = learner_metric(store, "rl1", "beta")
    assert len(value_losses) == 6 and all(v >= 0 for v in value_losses)
    assert len(kl) == 6
    # the adaptive controller moved beta away from its initial value
    assert betas[0] == pytest.approx(0.05, rel=0.05) and betas[-1] != betas[0]
