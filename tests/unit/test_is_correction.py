"""Behaviour/learner logprob mismatch metrics and truncated importance-sampling correction."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from shardrl.config import load_config
from shardrl.learner_backends import PolicyModule
from shardrl.stages.batch import build_batch
from shardrl.stages.update import (
    compute_loss,
    logprob_mismatch,
    masked_is_weight,
    truncated_is_weight,
)

LN2, LN4 = math.log(2.0), math.log(4.0)


def test_mismatch_metrics_hand_computed():
    behaviour = torch.tensor([[math.log(0.5), math.log(0.25), 7.0]])
    learner = torch.tensor([[math.log(0.25), math.log(0.25), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding: ignored
    m = logprob_mismatch(behaviour, learner, mask)
    # |delta| = ln 2 and 0 -> mean ln(2)/2
    assert m["logprob_mismatch_abs"].item() == pytest.approx(LN2 / 2, rel=1e-6)
    # k3 = r - 1 - ln r with r = learner/behaviour: r = 1/2 gives -1/2 + ln 2, r = 1 gives 0
    assert m["mismatch_k3"].item() == pytest.approx((-0.5 + LN2) / 2, rel=1e-6)


def test_truncated_weight_caps_the_ratio():
    learner = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    behaviour = torch.zeros(1, 3)
    w = truncated_is_weight(learner, behaviour, cap=2.0)
    # ratios 3, 0.5, 1 -> min(ratio, 2) = 2, 0.5, 1
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0], rel=1e-6)
    assert not w.requires_grad


def test_icepop_mask_keeps_the_ratio_inside_the_band_and_zeroes_the_rest():
    learner = torch.tensor([[math.log(3.0), math.log(0.5), 0.0, math.log(0.3)]])
    behaviour = torch.zeros(1, 4)
    w = masked_is_weight(learner, behaviour, low=0.5, cap=2.0)
    # ratios 3, 0.5, 1, 0.3 -> outside [0.5, 2] gives 0, inside keeps the ratio (edges in)
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0, 0.0], rel=1e-6)
    assert not w.requires_grad


def _table(policy: PolicyModule, shift: list[float]) -> pa.Table:
    """Two samples of one group whose behaviour logprobs are the learner's plus `shift[t]`."""
    rows = {"prompt_id": [0, 0], "group_id": [5, 5], "sample_idx": [0, 1],
            "prompt_token_ids": [[3, 4], [3, 4]], "response_token_ids": [[5, 6], [7, 8]],
            "advantage": [1.0, -0.5]}
    table = pa.table(rows)
    batch = build_batch(table, pad_id=0)
    with torch.no_grad():
        learner = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    behaviour = (learner + torch.tensor(shift)).tolist()
    return table.append_column("behavior_logprobs", pa.array(behaviour, pa.list_(pa.float32()))) \
        .append_column("ref_logprobs", pa.array([None, None], pa.list_(pa.float32())))


def _config(enabled: bool):
    return load_config("demo", [
        "algo.aggregation=token", "algo.loss={kind: cispo, max_ratio: 4.0}",
        "rollout.temperature=1.0", "algo.advantages.norm=none",
        "algo.kl.placement=none", f"algo.is_correction.enabled={str(enabled).lower()}",
        "algo.is_correction.cap=2.0", "algo.entropy_coef=0.0"])


@pytest.mark.parametrize("enabled", [False, True])
def test_synthetic_mismatch_is_reported_and_corrected(enabled: bool, tiny_policy):
    policy = tiny_policy
    # behaviour = learner + ln 4 on token 0 and learner - ln 4 on token 1 of every sample
    table = _table(policy, [LN4, -LN4])
    loss, metrics, batch = compute_loss(_config(enabled), policy, table, 0, beta=0.0)
    assert metrics["logprob_mismatch_abs"].item() == pytest.approx(LN4, rel=1e-5)
    # r = 1/4 and 4: k3 = (1/4 - 1 + ln 4 + 4 - 1 - ln 4) / 2 = 9/8
    assert metrics["mismatch_k3"].item() == pytest.approx(9 / 8, rel=1e-5)
    with torch.no_grad():
        logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    adv = torch.tensor([[1.0], [-0.5]])
    # token weights pi_learner / pi_behaviour = 1/4 and 4. Disabled: CISPO's own ratio
    # against the behaviour, capped at max_ratio 4. Enabled: the ratio against the learner-old
    # logprobs is 1 and the truncated IS weight min(r, cap 2) multiplies each token.
    weights = torch.tensor([[0.25, 2.0]]) if enabled else torch.tensor([[0.25, 4.0]])
    expected = (-adv * weights * logp).mean()  # token aggregation over the 4 response tokens
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())


def test_correction_off_without_mismatch_changes_nothing(tiny_policy):
    policy = tiny_policy
    table = _table(policy, [0.0, 0.0])
    off, m_off, _ = compute_loss(_config(False), policy, table, 0, beta=0.0)
    on, m_on, _ = compute_loss(_config(True), policy, table, 0, beta=0.0)
    assert m_off["logprob_mismatch_abs"].item() == pytest.approx(0.0, abs=1e-6)
    assert on.item() == pytest.approx(off.item(), rel=1e-5)


def test_icepop_mode_drops_the_tokens_the_engines_disagree_on(tiny_policy):
    policy = tiny_policy
    # behaviour = learner + ln 1.5 on token 0 (k = 2/3, inside [0.5, 2]) and learner - ln 4
    # on token 1 (k = 4, outside): token 1 gets no gradient at all
    table = _table(policy, [math.log(1.5), -LN4])
    cfg = load_config("demo", [
        "algo.loss={kind: cispo}", "algo.aggregation=token", "algo.kl.placement=none",
        "algo.entropy_coef=0.0", "algo.advantages.norm=none", "algo.is_correction.enabled=true",
        "algo.is_correction.mode=mask",
        "algo.is_correction.low=0.5", "algo.is_correction.cap=2.0"])
    loss, metrics, batch = compute_loss(cfg, policy, table, 0, beta=0.0)
    with torch.no_grad():
        logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    adv = torch.tensor([[1.0], [-0.5]])
    expected = (-adv * torch.tensor([[2 / 3, 0.0]]) * logp).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["is_masked_frac"].item() == pytest.approx(0.5)


def _kl_config(enabled: bool):
    return load_config("demo", [
        "algo.aggregation=token", "algo.loss={kind: cispo}", "rollout.temperature=1.0",
        "algo.advantages.norm=none", "algo.entropy_coef=0.0", "model.reference=initial",
        "algo.kl={placement: loss, estimator: k2, importance_cap: 3.0}",
        f"algo.is_correction.enabled={str(enabled).lower()}", "algo.is_correction.cap=2.0"])


@pytest.mark.parametrize(("enabled", "mean_weight"), [(False, (0.25 + 3.0) / 2),
                                                      (True, (0.25 + 2.0) / 2)])
def test_kl_in_the_loss_is_weighted_to_the_trained_policy(enabled, mean_weight, tiny_policy):
    """The tokens were sampled by the behaviour policy: weighted by pi_learner / pi_behaviour
    (detached, capped), the KL term's expected gradient is the trained policy's. Behaviour =
    learner + ln 4 on token 0 and - ln 4 on token 1 (weights 1/4 and 4, capped at
    `importance_cap` 3, or at the correction's cap 2 when it is on); reference = learner -
    ln 2 on both, so k2 = (ln 2)^2 / 2 on every token; advantages 0 leave the KL alone."""
    policy = tiny_policy
    table = _table(policy, [LN4, -LN4]).set_column(
        5, "advantage", pa.array([0.0, 0.0])).drop(["ref_logprobs"])
    batch = build_batch(table, pad_id=0)
    with torch.no_grad():
        learner = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    ref = learner - LN2
    table = table.append_column("ref_logprobs", pa.array(ref.tolist(), pa.list_(pa.float32())))
    loss, _, _ = compute_loss(_kl_config(enabled), policy, table, 0, beta=1.0)
    assert loss.item() == pytest.approx(mean_weight * LN2 ** 2 / 2, rel=1e-5)

    # the weight is a constant: the gradient is weight * (logp - ref) * grad logp
    policy.zero_grad()
    loss.backward()
    got = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    weights = torch.tensor([[0.25, 3.0 if not enabled else 2.0]])
    (weights * 0.5 * (logp - ref).square()).mean().backward()
    for g, p in zip(got, policy.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
