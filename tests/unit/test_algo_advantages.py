"""Advantage estimators: group-relative normalizations, GAE, and the registry."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.algo import (
    gae,
    get_advantage_estimator,
    group_advantages,
    known_advantage_estimators,
    known_advantage_norms,
    masked_whiten,
)

D = torch.float64
# groups: id 10 -> [1, 0, 1, 1], id 3 -> [5] (single sample), id 99 -> [2, 4]
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0, 2.0, 4.0], dtype=D)
GROUPS = torch.tensor([10, 10, 10, 10, 3, 99, 99])
# a = r - group mean: means 0.75, 5, 3
CENTERED = [0.25, -0.75, 0.25, 0.25, 0.0, -1.0, 1.0]


def test_group_advantages_none():
    out = group_advantages(REWARDS, GROUPS, "none")
    torch.testing.assert_close(out, torch.tensor(CENTERED, dtype=D))


def test_group_advantages_prompt_divides_by_the_group_std():
    out = group_advantages(REWARDS, GROUPS, "prompt", eps=0.0)
    # group 10: sum of squared deviations 3 * 0.0625 + 0.5625 = 0.75, / (4 - 1) -> std 0.5
    # group 3: one sample -> 0; group 99: (1 + 1) / (2 - 1) = 2 -> std sqrt(2)
    r2 = math.sqrt(2)
    expected = torch.tensor([0.5, -1.5, 0.5, 0.5, 0.0, -1 / r2, 1 / r2], dtype=D)
    torch.testing.assert_close(out, expected)


def test_group_advantages_batch_divides_by_the_std_of_centered_rewards():
    out = group_advantages(REWARDS, GROUPS, "batch", eps=0.0)
    # a sums to 0; sum of squares 3 * 0.0625 + 0.5625 + 0 + 1 + 1 = 2.75; std = sqrt(2.75 / 6)
    std = math.sqrt(2.75 / 6)
    torch.testing.assert_close(out, torch.tensor([x / std for x in CENTERED], dtype=D))


def test_group_advantages_default_eps_and_unknown_norm():
    out = group_advantages(REWARDS, GROUPS, "prompt")
    assert out[1].item() == pytest.approx(-0.75 / (0.5 + 1e-6))
    assert known_advantage_norms() == ["batch", "none", "prompt"]
    with pytest.raises(ValueError, match="batch, none, prompt"):
        group_advantages(REWARDS, GROUPS, "group")


@pytest.mark.parametrize("norm", ["none", "prompt", "batch"])
def test_single_sample_groups_and_constant_groups_give_zero(norm):
    out = group_advantages(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([4, 8, 8]), norm)
    assert (out == 0).all()
    single = group_advantages(torch.tensor([2.5]), torch.tensor([0]), norm)
    assert single.tolist() == [0.0]


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_prompt_norm_gives_zero_mean_unit_std_per_group(data):
    sizes = data.draw(st.lists(st.integers(2, 6), min_size=1, max_size=4))
    rewards = [data.draw(st.lists(st.floats(-5, 5), min_size=s, max_size=s)) for s in sizes]
    ids = torch.cat([torch.full((s,), 31 * g + 5) for g, s in enumerate(sizes)])
    flat = torch.tensor([x for group in rewards for x in group], dtype=D)
    out = group_advantages(flat, ids, "prompt")
    assert torch.isfinite(out).all()
    for g in range(len(sizes)):
        part, raw = out[ids == 31 * g + 5], flat[ids == 31 * g + 5]
        assert part.mean().item() == pytest.approx(0.0, abs=1e-6)
        if raw.std() > 0.1:  # eps = 1e-6 then moves the std by less than 1e-5
            assert part.std().item() == pytest.approx(1.0, rel=1e-4)


MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
TOKEN_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.2, 1.0, 9.0]], dtype=D)  # 9: padding
VALUES = torch.tensor([[0.5, 0.4, 0.3], [0.1, 0.6, 5.0]], dtype=D)  # 5: padding


def test_gae_hand_computed():
    adv, ret = gae(TOKEN_REWARDS, VALUES, MASK, gamma=0.9, lam=0.5)
    # gamma*lam = 0.45. Row 0, from the end:
    #  t=2: delta = 1 + 0.9*0 - 0.3 = 0.7;      A = 0.7
    #  t=1: delta = 0 + 0.9*0.3 - 0.4 = -0.13;  A = -0.13 + 0.45*0.7 = 0.185
    #  t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;  A = -0.14 + 0.45*0.185 = -0.05675
    # Row 1 (last response token t=1; V and A after it are 0):
    #  t=1: delta = 1 + 0 - 0.6 = 0.4;          A = 0.4
    #  t=0: delta = 0.2 + 0.9*0.6 - 0.1 = 0.64; A = 0.64 + 0.45*0.4 = 0.82
    expected = torch.tensor([[-0.05675, 0.185, 0.7], [0.82, 0.4, 0.0]], dtype=D)
    torch.testing.assert_close(adv, expected)
    # returns = A + V on response tokens, 0 elsewhere
    returns = torch.tensor([[0.44325, 0.585, 1.0], [0.92, 1.0, 0.0]], dtype=D)
    torch.testing.assert_close(ret, returns)


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    adv, ret = gae(TOKEN_REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    # A_t = sum_{k>=t} r_k - V_t: row 0 -> [1-0.5, 1-0.4, 1-0.3]; row 1 -> [1.2-0.1, 1-0.6]
    expected = torch.tensor([[0.5, 0.6, 0.7], [1.1, 0.4, 0.0]], dtype=D)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [1.2, 1.0, 0.0]], dtype=D))


def test_gae_outputs_carry_no_gradient_and_handle_empty_rows():
    values = VALUES.clone().requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    adv, ret = gae(TOKEN_REWARDS, values, mask, gamma=0.99, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    assert (adv[1] == 0).all() and (ret[1] == 0).all()


def test_estimator_registry():
    assert known_advantage_estimators() == ["gae", "group"]
    with pytest.raises(KeyError, match="gae, group"):
        get_advantage_estimator("vtrace")


def test_group_estimator_broadcasts_over_response_tokens():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=D)
    rewards = torch.tensor([1.0, 0.0, 4.0], dtype=D)
    estimator = get_advantage_estimator("group")
    adv, ret = estimator(rewards, mask, group_ids=torch.tensor([2, 2, 9]), norm="none")
    # group 2: mean 0.5 -> [0.5, -0.5]; group 9 alone -> 0
    expected = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]], dtype=D)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    # token rewards are summed over the response first: [0.4 + 0.6, 0] -> same advantages
    token_rewards = torch.tensor([[0.4, 0.6], [0.0, 7.0], [4.0, 0.0]], dtype=D)
    adv2, _ = estimator(token_rewards, mask, group_ids=torch.tensor([2, 2, 9]))
    torch.testing.assert_close(adv2, expected)
    with pytest.raises(ValueError, match="group_ids"):
        estimator(rewards, mask)


def test_gae_estimator_places_sequence_rewards_on_the_last_token():
    estimator = get_advantage_estimator("gae")
    seq_rewards = torch.tensor([1.0, 1.0], dtype=D)
    adv, ret = estimator(seq_rewards, MASK, values=VALUES, gamma=0.9, lam=0.5)
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=D)
    adv_ref, ret_ref = gae(token_rewards, VALUES, MASK, 0.9, 0.5)
    torch.testing.assert_close(adv, adv_ref)
    torch.testing.assert_close(ret, ret_ref)
    adv_tok, _ = estimator(TOKEN_REWARDS, MASK, values=VALUES, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv_tok, gae(TOKEN_REWARDS, VALUES, MASK, 0.9, 0.5)[0])
    with pytest.raises(ValueError, match="values"):
        estimator(seq_rewards, MASK, gamma=0.9, lam=0.5)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    # masked mean 2, Bessel variance (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1], padding -> 0
    out = masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=D))
    out = masked_whiten(x, mask, eps=0.0, shift_mean=False)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=D))
