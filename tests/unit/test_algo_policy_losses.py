"""Policy losses: hand-computed values, gradients against the papers' formulas, stability."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.algo import aggregate, get_policy_loss, known_policy_losses, policy_loss
from shardrl.algo.policy_losses import binary_kl, cispo_loss, dppo_tv_loss, gspo_loss, ppo_loss

D = torch.float64
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], dtype=D)
# Ratios chosen by hand: row 0 -> [1, 2, 0.5], row 1 -> [8, 0.25, (pad)].
RATIOS = torch.tensor([[1.0, 2.0, 0.5], [8.0, 0.25, 1.0]], dtype=D)
OLD = LOGPROBS - RATIOS.log()
ADV = torch.tensor([1.0, -2.0], dtype=D)
# approx_kl = mean of r - 1 - ln r over the five response tokens
APPROX_KL = (
    0.0 + (1 - math.log(2)) + (-0.5 + math.log(2)) + (7 - math.log(8)) + (-0.75 + math.log(4))
) / 5
RATIO_MEAN = (1 + 2 + 0.5 + 8 + 0.25) / 5  # 2.35


def _leaf():
    return LOGPROBS.clone().requires_grad_()


def test_registry_resolves_every_kind_and_lists_names_on_error():
    assert known_policy_losses() == ["cispo", "dppo_kl", "dppo_tv", "gspo", "ppo"]
    assert get_policy_loss("cispo") is cispo_loss
    assert get_policy_loss("ppo") is ppo_loss
    assert get_policy_loss("gspo") is gspo_loss
    assert get_policy_loss("dppo_tv") is dppo_tv_loss
    with pytest.raises(KeyError, match="cispo, dppo_kl, dppo_tv, gspo, ppo"):
        get_policy_loss("grpo")
    with pytest.raises(ValueError, match="known: cispo"):
        policy_loss("dapo", LOGPROBS, OLD, ADV, MASK)


def test_cispo_values_metrics_and_gradient():
    lp = _leaf()
    loss, metrics = policy_loss("cispo", lp, OLD, ADV, MASK, max_ratio=4.0)
    # w = clamp(r, max=4) = [[1, 2, 0.5], [4, 0.25]]; loss = -w * A * logprob:
    # row 0 (A=1):  -1*1*(-1)=1, -2*1*(-2)=4, -0.5*1*(-0.5)=0.25
    # row 1 (A=-2): -4*(-2)*(-1.5)=-12, -0.25*(-2)*(-0.2)=-0.1, pad 0
    expected = torch.tensor([[1.0, 4.0, 0.25], [-12.0, -0.1, 0.0]], dtype=D)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 5)  # only r=8 is clamped
    assert metrics["ratio_mean"].item() == pytest.approx(RATIO_MEAN)
    assert metrics["approx_kl"].item() == pytest.approx(APPROX_KL)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss.sum().backward()
    # d loss / d logprob = -w * A on every response token, none dropped (even r=8):
    grad = torch.tensor([[-1.0, -2.0, -0.5], [8.0, 0.5, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)


def test_cispo_lower_bound_counts_in_clip_frac():
    loss, metrics = cispo_loss(LOGPROBS, OLD, ADV, MASK, max_ratio=4.0, min_ratio=0.5)
    # r=0.25 -> w=0.5: -0.5*(-2)*(-0.2) = -0.2; r=0.5 sits on the bound, not clamped
    assert loss[1, 1].item() == pytest.approx(-0.2)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)


def test_ppo_values_clip_frac_and_zero_gradient_on_clipped_tokens():
    lp = _leaf()
    loss, metrics = policy_loss("ppo", lp, OLD, ADV, MASK, eps_low=0.2, eps_high=0.2)
    # loss = max(-A r, -A clamp(r, 0.8, 1.2)):
    # A=1:  r=1 -> max(-1, -1) = -1; r=2 -> max(-2, -1.2) = -1.2 (clipped);
    #       r=0.5 -> max(-0.5, -0.8) = -0.5
    # A=-2: r=8 -> max(16, 2.4) = 16; r=0.25 -> max(0.5, 1.6) = 1.6 (clipped)
    expected = torch.tensor([[-1.0, -1.2, -0.5], [16.0, 1.6, 0.0]], dtype=D)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx(RATIO_MEAN)
    assert metrics["approx_kl"].item() == pytest.approx(APPROX_KL)
    assert "dual_clip_frac" not in metrics
    loss.sum().backward()
    # unclipped tokens: -A * r = [-1, _, -0.5], [16, _]; clipped tokens: 0
    grad = torch.tensor([[-1.0, 0.0, -0.5], [16.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)


def test_ppo_asymmetric_clip_and_dual_clip():
    lp = _leaf()
    loss, metrics = ppo_loss(lp, OLD, ADV, MASK, eps_low=0.2, eps_high=1.5, dual_clip=3.0)
    # eps_high=1.5: r=2 is inside [0.8, 2.5] -> -2, unclipped.
    # dual clip caps A=-2 tokens at -3*A = 6: r=8's 16 -> 6 (no gradient); 1.6 stays.
    expected = torch.tensor([[-1.0, -2.0, -0.5], [6.0, 1.6, 0.0]], dtype=D)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 5)  # only r=0.25
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)
    loss.sum().backward()
    grad = torch.tensor([[-1.0, -2.0, -0.5], [0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(LOGPROBS, OLD, ADV, MASK, dual_clip=1.0)


def test_gspo_uses_the_sequence_ratio():
    token_log_ratio = torch.tensor([[0.1, -0.1, 0.3], [0.02, -0.04, 7.0]], dtype=D)
    lp = _leaf()
    loss, metrics = gspo_loss(
        lp, LOGPROBS - token_log_ratio, ADV, MASK, eps_low=0.05, eps_high=0.05
    )
    s0 = math.exp(0.1)  # mean(0.1, -0.1, 0.3) = 0.1 -> 1.10517 > 1.05: clipped for A=1
    s1 = math.exp(-0.01)  # mean(0.02, -0.04) = -0.01 -> 0.99005, inside [0.95, 1.05]
    # row 0: max(-s0, -1.05) = -1.05 on each token; row 1: -A s1 = 2 s1 = 1.9801
    expected = torch.tensor([[-1.05] * 3, [2 * s1, 2 * s1, 0.0]], dtype=D)
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_frac"].item() == pytest.approx(3 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx((3 * s0 + 2 * s1) / 5)
    k3 = [math.exp(x) - 1 - x for x in (0.1, -0.1, 0.3, 0.02, -0.04)]
    assert metrics["approx_kl"].item() == pytest.approx(sum(k3) / 5)
    loss.sum().backward()
    # each token's ratio has derivative s_i: clipped row 0 -> 0; row 1 -> -A s1 = 2 s1
    grad = torch.tensor([[0.0, 0.0, 0.0], [2 * s1, 2 * s1, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)


def test_gspo_token_advantages_reduce_to_their_response_mean():
    adv_tokens = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -3.0, 50.0]], dtype=D)  # means 1, -2
    a, _ = gspo_loss(LOGPROBS, OLD, adv_tokens, MASK)
    b, _ = gspo_loss(LOGPROBS, OLD, ADV, MASK)
    torch.testing.assert_close(a, b)


def _random_batch(seed: int, spread: float):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=gen, dtype=D) * 3
    old = lp + spread * torch.randn(4, 6, generator=gen, dtype=D)
    lengths = torch.tensor([6, 1, 3, 5])
    mask = (torch.arange(6) < lengths[:, None]).to(D)
    adv = torch.randn(4, generator=gen, dtype=D)
    return lp, old, adv, mask


def _paper_ppo(lp, old, adv, mask, eps_low, eps_high, dual_clip):
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -dual_clip * a), loss)
    return loss * mask


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000), spread=st.floats(0.01, 1.0), dual=st.sampled_from([None, 1.5, 3.0])
)
def test_ppo_matches_autograd_through_the_formula(seed, spread, dual):
    lp, old, adv, mask = _random_batch(seed, spread)
    mine, ref = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    loss, _ = ppo_loss(mine, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=dual)
    expected = _paper_ppo(ref, old, adv, mask, 0.2, 0.28, dual)
    torch.testing.assert_close(loss, expected)
    aggregate(loss, mask, "token").backward()
    aggregate(expected, mask, "token").backward()
    torch.testing.assert_close(mine.grad, ref.grad)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.01, 2.0))
def test_cispo_gradient_is_minus_weight_times_advantage(seed, spread):
    lp, old, adv, mask = _random_batch(seed, spread)
    lp.requires_grad_()
    loss, _ = cispo_loss(lp, old, adv, mask, max_ratio=2.0, min_ratio=0.5)
    loss.sum().backward()
    weight = torch.exp(lp.detach() - old).clamp(0.5, 2.0)
    torch.testing.assert_close(lp.grad, -weight * adv[:, None] * mask)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    spread=st.floats(1e-4, 0.5),
    eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.2), (10.0, 10.0)]),
)
def test_gspo_gradient_flows_through_the_sequence_ratio(seed, spread, eps):
    lp, old, adv, mask = _random_batch(seed, spread)
    mine, ref = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    loss, _ = gspo_loss(mine, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    aggregate(loss, mask, "sample").backward()
    # GSPO's sequence objective: s_i = exp(mean_t (lp - old)), loss_i = -min(s A, clip(s) A)
    s = torch.exp(((ref - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = torch.maximum(-adv * s, -adv * s.clamp(1 - eps[0], 1 + eps[1]))
    seq_loss.mean().backward()
    torch.testing.assert_close(mine.grad, ref.grad)


@pytest.mark.parametrize("kind", ["cispo", "ppo", "gspo"])
def test_extreme_log_ratios_and_masked_rows_stay_finite(kind):
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0]])
    old = lp + torch.tensor([[1000.0, -1000.0, 0.0], [0.0, 0.0, 0.0], [-1000.0, 1000.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    lp.requires_grad_()
    adv = torch.tensor([1.0, -1.0, -2.0])
    loss, metrics = policy_loss(kind, lp, old, adv, mask)
    assert torch.isfinite(loss).all()
    assert (loss[1] == 0).all()  # fully masked row
    assert all(torch.isfinite(v) for v in metrics.values())
    for mode in ("token", "sample", "prompt"):
        total = aggregate(loss, mask, mode, torch.tensor([5, 6, 5]))
        assert torch.isfinite(total)
    aggregate(loss, mask, "token").backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[1] == 0).all()


@pytest.mark.parametrize("kind", ["cispo", "ppo", "gspo"])
def test_fully_masked_batch_gives_zero_loss_and_metrics(kind):
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(kind, lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert (loss == 0).all()
    assert all(v.item() == 0 for v in metrics.values())
    assert aggregate(loss, torch.zeros(2, 3), "sample").item() == 0


def test_bool_mask_and_float32_inputs_match_float64():
    loss32, _ = policy_loss("ppo", LOGPROBS.float(), OLD.float(), ADV.float(), MASK.bool())
    loss64, _ = policy_loss("ppo", LOGPROBS, OLD, ADV, MASK)
    assert loss32.dtype == torch.float32
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-5)


# DPPO by hand: old token probabilities q, new ones p (rows: A = +1, -2, +1)
DPPO_Q = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.1], [0.01, 0.5, 0.5]], dtype=D)
DPPO_P = torch.tensor([[0.7, 0.6, 0.2], [0.3, 0.45, 0.9], [0.1, 0.5, 0.5]], dtype=D)
DPPO_ADV = torch.tensor([1.0, -2.0, 1.0], dtype=D)
DPPO_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=D)


def _dppo(kind: str, delta: float):
    lp = DPPO_P.log().requires_grad_()
    loss, metrics = policy_loss(kind, lp, DPPO_Q.log(), DPPO_ADV, DPPO_MASK,
                                delta_low=delta, delta_high=delta, max_ratio=4.0)
    loss.sum().backward()
    return lp, loss, metrics


def test_dppo_tv_masks_tokens_moved_past_the_region_in_the_advantage_direction():
    lp, loss, metrics = _dppo("dppo_tv", 0.15)
    # row 0 (A=+1): 0.5->0.7 rose 0.2 > 0.15: masked; 0.5->0.6 rose 0.1: w = 1.2;
    #   0.5->0.2 fell, against the advantage: kept, w = 0.4
    # row 1 (A=-2): 0.5->0.3 fell 0.2: masked; 0.5->0.45: w = 0.9; 0.1->0.9 rose, against
    #   the advantage: kept, w = min(9, 4) = 4
    # row 2 (A=+1): 0.01->0.1 rose 0.09 < 0.15: kept, w = min(10, 4) = 4
    grad = torch.tensor([[0.0, -1.2, -0.4], [0.0, 1.8, 8.0], [-4.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)
    torch.testing.assert_close(loss, grad * DPPO_P.log())  # -w * A * logprob, 0 where masked
    assert metrics["clip_frac"].item() == pytest.approx(2 / 7)


def test_binary_kl_by_hand():
    # KL(Bern(0.5) || Bern(0.7)) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3)
    want = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert binary_kl(torch.tensor(0.5, dtype=D), torch.tensor(0.7, dtype=D)).item() == \
        pytest.approx(want, rel=1e-6)
    assert want == pytest.approx(0.087177, abs=1e-6)


def test_dppo_kl_bounds_the_move_of_rare_tokens_that_tv_lets_through():
    lp, _, metrics = _dppo("dppo_kl", 0.05)
    # binary KL: 0.5->0.7 and 0.5->0.3: 0.0872 > 0.05, masked; 0.5->0.6: 0.0204 and
    # 0.5->0.45: 0.0050, kept; 0.01->0.1: 0.01 ln 0.1 + 0.99 ln(0.99/0.9) = 0.0713 > 0.05,
    # masked, where TV (a rise of 0.09) let it through
    grad = torch.tensor([[0.0, -1.2, -0.4], [0.0, 1.8, 8.0], [0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, grad)
    assert metrics["clip_frac"].item() == pytest.approx(3 / 7)
