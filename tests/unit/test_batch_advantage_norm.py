"""`advantages.norm: batch` is ScaleRL's normalization over the learner's batch: prepare only
centers each group, and the learner divides by the std of the rows it trains on together."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from shardrl.algo import batch_normalize, group_advantages, shard_norm
from shardrl.config import load_config
from shardrl.stages.batch import build_batch
from shardrl.stages.update import compute_loss


def test_prepare_centers_and_the_batch_std_is_the_learners():
    assert shard_norm("batch") == "none"
    assert shard_norm("prompt") == "prompt" and shard_norm("none") == "none"
    # two shards of one group each, as prepare sees them: centred only
    a1 = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long),
                          shard_norm("batch"))
    a2 = group_advantages(torch.tensor([6.0, 0.0]), torch.zeros(2, dtype=torch.long),
                          shard_norm("batch"))
    assert a1.tolist() == [0.5, -0.5, 0.5, -0.5] and a2.tolist() == [3.0, -3.0]
    # the learner's batch of both: sum of squares 4 * 0.25 + 2 * 9 = 19, Bessel /5: std
    # sqrt(3.8); per shard the std would be sqrt(1/3) and sqrt(18), other scales entirely
    got = batch_normalize(torch.cat([a1, a2]), eps=0.0)
    std = math.sqrt(19 / 5)
    assert got.tolist() == pytest.approx([0.5 / std, -0.5 / std, 0.5 / std, -0.5 / std,
                                          3 / std, -3 / std], rel=1e-6)


def test_the_learner_divides_the_batch_by_its_std(tiny_policy):
    policy = tiny_policy
    adv = [0.5, -0.5, 3.0, -3.0]
    table = pa.table({"prompt_id": [0, 0, 1, 1], "group_id": [0, 0, 1, 1],
                      "sample_idx": [0, 1, 0, 1], "prompt_token_ids": [[3, 4]] * 4,
                      "response_token_ids": [[5, 6], [7, 8], [5, 7], [6, 8]],
                      "advantage": adv})
    batch = build_batch(table, pad_id=0)
    with torch.no_grad():
        logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    table = table.append_column("behavior_logprobs", pa.array(logp.tolist(),
                                                               pa.list_(pa.float32()))) \
        .append_column("ref_logprobs", pa.array([None] * 4, pa.list_(pa.float32())))
    base = ["algo.loss={kind: cispo}", "algo.aggregation=token", "algo.kl.placement=none",
            "algo.entropy_coef=0.0"]
    loss, _, _ = compute_loss(load_config("demo", base + ["algo.advantages.norm=batch"]),
                              policy, table, 0, beta=0.0)
    # ratio 1 (behaviour = learner): CISPO's loss is -A * logprob, A / (std + 1e-6) with std
    # of [0.5, -0.5, 3, -3] = sqrt(18.5 / 3)
    scaled = torch.tensor(adv) / (math.sqrt(18.5 / 3) + 1e-6)
    expected = (-scaled[:, None] * logp).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    plain, _, _ = compute_loss(load_config("demo", base + ["algo.advantages.norm=none"]),
                               policy, table, 0, beta=0.0)
    assert plain.item() == pytest.approx((-torch.tensor(adv)[:, None] * logp).mean().item(),
                                         rel=1e-5)
