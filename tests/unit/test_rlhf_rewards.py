"""The PPO-RLHF reward path: prepare shapes the reward-model score once (normalised with
running moments, clipped), and the learner's GAE rewards are that shaped score on the last
response token plus -beta * KL on every response token, the KL never normalised."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from shardrl.config import load_config
from shardrl.stages.batch import build_batch, padded_column
from shardrl.stages.prepare import Preparer
from shardrl.stages.update import gae_rewards
from shardrl.store import LocalStore, RunKeys
from shardrl.store.schemas import SCORED


def scored(reward_rm: list[float], behaviour: list[list[float]], ref: list[list[float]]) -> pa.Table:
    n = len(reward_rm)
    cols = {
        "prompt_id": [f"p{i}" for i in range(n)], "group_id": [f"w00-000000-{i:03d}" for i in range(n)],
        "sample_idx": [0] * n, "policy_version": [0] * n, "worker": [0] * n,
        "prompt_text": ["ab="] * n, "prompt_token_ids": [[1, 2, 3]] * n,
        "response_token_ids": [[4] * len(b) for b in behaviour], "behavior_logprobs": behaviour,
        "finish_reason": ["stop"] * n, "response_text": ["x"] * n, "answer": ["x"] * n,
        "category": ["c"] * n, "created_at": [0.0] * n,
        "reward_verifier": [None] * n, "reward_model": reward_rm, "reward_rm": reward_rm,
        "correct": [None] * n, "reward_error": [None] * n, "ref_logprobs": ref,
    }
    return pa.table(cols, schema=SCORED)


def preparer(tmp_path, cfg) -> Preparer:
    ctx = SimpleNamespace(cfg=cfg, keys=RunKeys("rlhf"), store=LocalStore(tmp_path),
                          metrics=SimpleNamespace(log=lambda step, values: None))
    return Preparer(ctx)


BEHAVIOUR = [[-1.0, -2.0], [-0.5, -0.5, -0.5], [-1.0]]
REF = [[-1.5, -1.0], [-0.5, -1.5, -0.25], [-1.0]]


def test_prepare_shapes_the_score_and_leaves_the_kl_to_the_learner(tmp_path):
    # ppo-rlhf: normalize with running moments, clip 5, alpha 1, KL in the reward, GAE
    cfg = load_config("ppo-rlhf", ["algo.shaping.clip=1.0"])
    ready = preparer(tmp_path, cfg).prepare(scored([3.0, 0.0, 0.0], BEHAVIOUR, REF))
    # mean 1, Bessel std sqrt(((2)^2 + 1 + 1) / 2) = sqrt(3): 2/sqrt(3) = 1.155 -> clipped to
    # 1; -1/sqrt(3) = -0.577 twice. No KL term: the learner adds it per token.
    want = [1.0, -1 / math.sqrt(3), -1 / math.sqrt(3)]
    assert ready.column("reward_total").to_pylist() == pytest.approx(want, rel=1e-5)


def test_prepare_puts_the_sequence_kl_in_the_total_for_group_advantages(tmp_path):
    cfg = load_config("ppo-rlhf", ["algo.advantages.estimator=group", "algo.critic=null",
                                   "algo.shaping.normalize=false", "algo.shaping.clip=null"])
    ready = preparer(tmp_path, cfg).prepare(scored([3.0, 0.0, 0.0], BEHAVIOUR, REF))
    beta = cfg.algo.kl.controller.init_beta
    # k1 summed over each response: 0.5 - 1.0 = -0.5; 0 + 1.0 - 0.25 = 0.75; 0
    want = [3.0 + 0.5 * beta, -0.75 * beta, 0.0]
    assert ready.column("reward_total").to_pylist() == pytest.approx(want, rel=1e-5)


def test_gae_rewards_shaped_score_on_the_last_token_and_kl_on_every_token():
    cfg = load_config("ppo-rlhf")  # k1 estimator, KL in the reward
    table = scored([9.0, -9.0, 0.0], BEHAVIOUR, REF).append_column(
        "reward_total", pa.array([2.0, -1.0, 0.5], pa.float32()))
    batch = build_batch(table, pad_id=0)
    behaviour = batch.pad_response(padded_column(table, "behavior_logprobs"))
    rewards = gae_rewards(cfg, table, batch, behaviour, beta=0.1)
    # row 0: k1 = [0.5, -1.0] -> [-0.05, +0.1 + 2.0]; row 1: k1 = [0, 1, -0.25] ->
    # [0, -0.1, 0.025 - 1.0]; row 2: k1 = [0] -> [0.5]. Padding stays 0. The raw reward_rm
    # (9, -9, 0) appears nowhere: the shaped reward_total is the score.
    want = torch.tensor([[-0.05, 2.1, 0.0], [0.0, -0.1, -0.975], [0.5, 0.0, 0.0]])
    assert torch.allclose(rewards, want, atol=1e-6)


def test_gae_rewards_without_kl_in_the_reward():
    cfg = load_config("ppo-rlhf", ["algo.kl.placement=none"])
    table = scored([9.0, -9.0, 0.0], BEHAVIOUR, REF).append_column(
        "reward_total", pa.array([2.0, -1.0, 0.5], pa.float32()))
    batch = build_batch(table, pad_id=0)
    rewards = gae_rewards(cfg, table, batch, torch.zeros(3, 3), beta=0.1)
    want = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]])
    assert torch.allclose(rewards, want, atol=1e-6)


def test_an_overflowed_total_is_written_as_zero_and_left_out_of_the_logged_statistics(tmp_path):
    """A finite score whose shaping overflows float32 (1e38 times alpha 10) trains on
    nothing; its row used to carry float32's largest value, which the logged means and the
    advantage maximum then showed as an explosion."""
    cfg = load_config("demo", ["algo.shaping.alpha=10", "algo.shaping.normalize=false",
                               "algo.shaping.clip=null", "algo.kl.placement=loss"])
    logged: list[dict] = []
    prep = preparer(tmp_path, cfg)
    prep.ctx.metrics = SimpleNamespace(log=lambda step, values: logged.append(values))
    table = scored([1e38, 0.0, 1.0], BEHAVIOUR, REF)
    table = table.set_column(table.schema.get_field_index("group_id"), "group_id",
                             pa.array(["g0", "g0", "g1"]))
    ready = prep.prepare(table)
    assert ready.column("filter_reason").to_pylist()[:2] == ["non_finite", "non_finite"]
    assert ready.column("reward_total").to_pylist()[:2] == [0.0, 0.0]
    assert ready.column("advantage").to_pylist()[:2] == [0.0, 0.0]
    assert ready.column("keep").to_pylist()[:2] == [False, False]
    # only the third row is usable: its total is 10, its group of one gives advantage 0
    assert logged[-1]["reward_total_mean"] == pytest.approx(10.0)
    assert logged[-1]["advantage_abs_max"] == 0.0


def test_a_group_whose_shaped_rewards_are_equal_is_filtered_like_one_whose_scores_are(tmp_path):
    """Clipping can make a group's different scores equal: its advantages are all 0, so it
    is no signal, and counting it as kept would fill steps with nothing to learn from."""
    cfg = load_config("demo", ["algo.shaping.normalize=false", "algo.shaping.clip=0.5",
                               "algo.kl.placement=loss"])
    table = scored([1.0, 2.0, 0.25, 0.5], [[-1.0]] * 4, [[-1.0]] * 4)
    table = table.set_column(table.schema.get_field_index("group_id"), "group_id",
                             pa.array(["g0", "g0", "g1", "g1"]))
    ready = preparer(tmp_path, cfg).prepare(table)
    assert ready.column("reward_total").to_pylist() == [0.5, 0.5, 0.25, 0.5]
    assert ready.column("keep").to_pylist() == [False, False, True, True]
    assert ready.column("filter_reason").to_pylist() == ["zero_variance"] * 2 + [None] * 2
