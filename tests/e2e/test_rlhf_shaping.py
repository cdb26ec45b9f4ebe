"""The ppo-rlhf preset's reward shaping reaches the critic's value targets.

One real shard (the tiny policy's rollout, scored by a reward model with reference
logprobs) is prepared and trained on once per shaping setting, each in its own run: the
prepare stage writes `reward_total`, and the learner's first update turns it into token
rewards and GAE returns, which are recorded where they enter the value loss. The settings
differ in shaping alone, so the returns differ by the shaped score's change, discounted by
`gamma * lam` per token before the last: normalising puts the scores at mean 0 and std 1,
and clipping at c bounds the score part of every target by c.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from shardrl.store import LocalStore, RunKeys, read_shard
from shardrl.store.schemas import READY, SCORED

from .conftest import TINY
from .rounds import one_thread, run_round, tiny_config

EPS = 1e-8  # RunningMoments.normalize's


def _reward_model(folder) -> None:
    """An untrained tiny sequence classifier over the cipher task's characters: any scalar
    score will do, the shaping is what is tested."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from shardrl.models.tiny import train_tokenizer

    tok = train_tokenizer(["abcdefghij="], folder)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                         num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config)
    with torch.no_grad():  # scores of order 1 rather than 0.01 (a fresh head's scale)
        rm.score.weight.mul_(100.0)
    rm.save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture
def scored_run(tmp_path, monkeypatch):
    """(store, folder, config text, config): run `scored` holds one scored shard of the
    ppo-rlhf preset on tiny settings, with a reward model and reference logprobs."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    _reward_model(tmp_path / "rm")
    base = (TINY.replace("extends: demo", "extends: ppo-rlhf")
            + f"reward: {{reward_model: {{path: '{tmp_path / 'rm'}'}}}}\n")
    store = LocalStore(tmp_path / "store")
    with one_thread():
        cfg = tiny_config(tmp_path, base, ("rollout.workers=1",))
        assert not cfg.inline_postprocess  # a reward model: score and prepare are stages
        for stage in ("snapshot", "rollout", "score"):
            torch.manual_seed(0)
            run_round(store, cfg, "scored", stage)
    return store, tmp_path, base, cfg


def _copy_run(store: LocalStore, src: str, dst: str) -> None:
    s, d = RunKeys(src), RunKeys(dst)
    for key in store.list(s.root):
        store.put_bytes(d.root + key[len(s.root):], store.get_bytes(key))


def test_clip_and_normalize_change_the_value_targets(scored_run, monkeypatch):
    store, folder, base, cfg = scored_run
    algo = cfg.algo
    assert (algo.advantages.estimator, algo.kl.placement, algo.shaping.alpha) == (
        "gae", "reward", 1.0)
    assert (algo.shaping.normalize, algo.shaping.clip) == (True, 5.0)  # the preset's shaping
    from shardrl.stages import update

    seen: list[dict[str, torch.Tensor]] = []
    value_loss = update.value_loss
    signature = inspect.signature(value_loss)

    def recording(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        seen.append({"values": given["old_values"].clone(), "returns": given["returns"].clone(),
                     "mask": given["mask"].clone()})
        return value_loss(*args, **kwargs)

    monkeypatch.setattr(update, "value_loss", recording)

    def train_once(run_id: str, shaping: dict) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """(reward_total of the ready shard, what the value loss got) for one setting."""
        cfg = tiny_config(folder, base, ("rollout.workers=1",) + tuple(
            f"algo.shaping.{k}={'null' if v is None else v}" for k, v in shaping.items()))
        _copy_run(store, "scored", run_id)
        with one_thread():
            run_round(store, cfg, run_id, "prepare")
            torch.manual_seed(0)  # the same critic head for every setting
            run_round(store, cfg, run_id, "learn")
        keys = RunKeys(run_id)
        [ready_key] = store.list(keys.kind_prefix("ready"))
        ready = read_shard(store, ready_key, READY)
        assert all(ready.column("keep").to_pylist())
        assert len(seen) == 1, "one update, one value loss"
        return ready.column("reward_total").to_numpy().astype(np.float64), seen.pop()

    [scored_key] = store.list(RunKeys("scored").kind_prefix("scored"))
    rm = read_shard(store, scored_key, SCORED).column("reward_rm").to_numpy().astype(np.float64)
    z = (rm - rm.mean()) / (rm.std(ddof=1) + EPS)  # normalised with this shard's moments
    assert np.ptp(rm) > 0.1 and np.abs(z).max() < 5.0  # the preset's clip at 5 does not bite
    c_raw, c_norm = float(0.5 * np.abs(rm).max()), float(0.5 * np.abs(z).max())
    settings = {  # shaping -> the score part it should give each sample
        "off": ({"normalize": False, "clip": None}, rm),
        "preset": ({}, z),  # the preset's own: normalize, clip 5
        "clip": ({"normalize": False, "clip": repr(c_raw)}, np.clip(rm, -c_raw, c_raw)),
        "both": ({"clip": repr(c_norm)}, np.clip(z, -c_norm, c_norm)),
    }
    results = {}
    for name, (shaping, score) in settings.items():
        total, got = train_once(name, shaping)
        # alpha 1, and with GAE prepare leaves the KL to the learner: the total is the score
        np.testing.assert_allclose(total, score, rtol=1e-5, atol=1e-6)
        results[name] = got

    off = results["off"]
    mask = off["mask"] > 0  # (B, T) response tokens
    lengths = mask.sum(-1)  # (B,)
    rows = torch.arange(len(rm))
    last = lengths - 1
    assert (lengths > 0).all()
    gamma_lam = algo.advantages.gamma * algo.advantages.lam  # 1.0 * 0.95 in the preset
    # the position of each token counted from its response's end: 0 on the last token
    from_end = (last[:, None] - torch.arange(mask.shape[1])[None, :]).clamp_min(0)
    discount = gamma_lam ** from_end.double()  # (B, T)
    # off: shaping off, the raw score. The return on a response's last token is the score
    # plus that token's KL penalty, which this run gives: what is left is the score part
    kl_last = off["returns"][rows, last].double().numpy() - rm
    parts = {}
    for name, (_, score) in settings.items():
        got = results[name]
        # same samples, policy and critic: the settings differ in the rewards alone
        assert torch.equal(got["mask"], off["mask"])
        assert torch.equal(got["values"], off["values"])
        change = torch.from_numpy(score - rm)[:, None] * discount * mask  # (B, T)
        diff = (got["returns"].double() - off["returns"].double()) * mask
        torch.testing.assert_close(diff, change, rtol=1e-4, atol=2e-5)
        parts[name] = got["returns"][rows, last].double().numpy() - kl_last

    # normalising: the score parts of the targets have mean 0 and std 1 over the shard
    np.testing.assert_allclose(parts["off"], rm, atol=1e-4)
    assert parts["preset"].mean() == pytest.approx(0.0, abs=1e-4)
    assert parts["preset"].std(ddof=1) == pytest.approx(1.0, abs=1e-4)
    assert not np.allclose(parts["preset"], rm, atol=1e-2)
    # clipping at c: no score part beyond c, and the samples beyond it sit exactly at +-c
    for name, raw, c in (("clip", rm, c_raw), ("both", z, c_norm)):
        part = parts[name]
        outside = np.abs(raw) > c
        assert outside.any() and (np.abs(part) <= c + 1e-4).all(), (name, part, c)
        np.testing.assert_allclose(part[outside], np.sign(raw[outside]) * c, atol=1e-4)
        np.testing.assert_allclose(part[~outside], raw[~outside], atol=1e-4)
