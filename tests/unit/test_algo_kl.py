"""KL estimators, sequence statistics and KL controllers over sequences of updates."""

import json
import math

import pytest
import torch

from shardrl.algo import (
    AdaptiveKLController,
    ExpKLController,
    FixedKLController,
    get_kl_controller,
    get_kl_estimator,
    kl_penalty,
    kl_stats,
    known_kl_controllers,
    known_kl_estimators,
)

D = torch.float64
LOGPROBS = torch.tensor([[-1.0, -2.0]], dtype=D)
REF = torch.tensor([[-1.5, -1.0]], dtype=D)  # d = logprobs - ref = [0.5, -1]


def test_estimators_hand_computed():
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF, "k1"), torch.tensor([[0.5, -1.0]], dtype=D)
    )
    # k2 = d^2 / 2 = [0.125, 0.5]
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF, "k2"), torch.tensor([[0.125, 0.5]], dtype=D)
    )
    # k3 = exp(-d) - 1 + d = [exp(-0.5) - 0.5, exp(1) - 2] = [0.1065, 0.7183]
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]], dtype=D)
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF, "k3"), k3)


def test_in_the_loss_k2_pulls_along_the_reverse_kl_and_k3_along_the_forward_kl():
    """In the loss only an estimator's gradient acts, on tokens drawn from the policy: the
    expectation of grad k2 is grad KL(pi || ref), that of grad k3 is grad KL(ref || pi).
    Exact expectations over a 3-token softmax pi = softmax(theta) against ref = [0.5, 0.3, 0.2]:
    with d = log pi - log ref, grad k2 = d grad log pi and grad k3 = (1 - ref / pi) grad log pi,
    so E[grad k3] = sum(pi - ref) grad log pi = -sum ref grad log pi = grad KL(ref || pi)."""
    theta = torch.tensor([0.3, -0.2, 0.1], dtype=D, requires_grad=True)
    ref = torch.tensor([0.5, 0.3, 0.2], dtype=D).log()

    def expected_grad(estimator: str) -> torch.Tensor:
        logp = theta.log_softmax(-1)
        weights = logp.exp().detach()  # the sampling distribution: no gradient through it
        value = (weights * kl_penalty(logp[None], ref[None], estimator)[0]).sum()
        return torch.autograd.grad(value, theta)[0]

    def grad_of(kl: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(kl, theta)[0]

    logp = theta.log_softmax(-1)
    reverse = grad_of((logp.exp() * (logp - ref)).sum())
    logp = theta.log_softmax(-1)
    forward = grad_of((ref.exp() * (ref - logp)).sum())
    torch.testing.assert_close(expected_grad("k2"), reverse)
    torch.testing.assert_close(expected_grad("k3"), forward)
    assert not torch.allclose(reverse, forward)  # the two differ here
    # by hand: pi = softmax([0.3, -0.2, 0.1]); d(-sum ref log pi)/d theta = pi - ref
    pi = torch.softmax(theta.detach(), -1)
    torch.testing.assert_close(forward, pi - ref.exp())


def test_estimator_registry():
    assert known_kl_estimators() == ["k1", "k2", "k3"]
    assert get_kl_estimator("k2")(LOGPROBS, REF).shape == (1, 2)
    with pytest.raises(KeyError, match="k1, k2, k3"):
        kl_penalty(LOGPROBS, REF, "low_var_kl")


def test_k3_is_finite_and_nonnegative_for_extreme_log_ratios():
    d = torch.tensor([[-1000.0, -30.0, 0.0, 30.0, 1000.0]])
    k3 = kl_penalty(d, torch.zeros_like(d), "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    # above the clamp the value is exact: d=30 -> exp(-30) - 1 + 30
    assert k3[0, 3].item() == pytest.approx(29.0)


def test_k3_gradient_is_exact_inside_the_clamp_and_zero_below_it():
    # dk3/dd = 1 - exp(-d): d=-1 -> 1 - e = -1.71828; d=0 -> 0; d=2 -> 1 - exp(-2) = 0.86466;
    # d=30 -> 1 - exp(-30), 1 to float32; d=-21 and -25 lie below the clamp (-20): 0, where
    # the true gradient is hugely negative (never +1, which would push the token further down)
    d = torch.tensor([[-1.0, 0.0, 2.0, 30.0, -21.0, -25.0]], requires_grad=True)
    kl_penalty(d, torch.zeros_like(d), "k3").sum().backward()
    expected = torch.tensor([[1 - math.e, 0.0, 1 - math.exp(-2.0), 1.0, 0.0, 0.0]])
    torch.testing.assert_close(d.grad, expected)


def test_kl_stats_sum_and_mean_over_response_tokens():
    tokens = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    stats = kl_stats(tokens, mask)
    # sums [1 + 2, 4, 0]; means [3 / 2, 4 / 1, 0 (no token)]
    torch.testing.assert_close(stats.kl_sum, torch.tensor([3.0, 4.0, 0.0]))
    torch.testing.assert_close(stats.kl_mean, torch.tensor([1.5, 4.0, 0.0]))


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 10.0, 1e6):
        assert ctl.update(kl, 128) == 0.05
    assert ctl.beta == 0.05


def test_adaptive_controller_over_a_sequence_of_updates():
    ctl = AdaptiveKLController(init_beta=0.1, target=6.0, horizon=10_000)
    # kl=9: e = clip(9/6 - 1 = 0.5) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 1e4) = 0.100512
    assert ctl.update(9.0, 256) == pytest.approx(0.100512)
    # kl=3: e = clip(-0.5) = -0.2; beta *= 1 - 0.00512 -> 0.100512 * 0.99488 = 0.0999973786
    assert ctl.update(3.0, 256) == pytest.approx(0.0999973786)
    # kl=6.6: e = 0.1 (inside the clip); beta *= 1 + 0.1 * 512 / 1e4 = 1.00512
    assert ctl.update(6.6, 512) == pytest.approx(0.0999973786 * 1.00512)
    # kl on target: unchanged
    before = ctl.beta
    assert ctl.update(6.0, 512) == pytest.approx(before)


def test_exp_controller_over_a_sequence_of_updates():
    ctl = ExpKLController(init_beta=0.1, target=0.5, rate=0.1)
    # kl=1: exponent (1 - 0.5) / 0.5 * 0.1 = 0.1 -> 0.1 * e^0.1
    assert ctl.update(1.0, 1) == pytest.approx(0.1 * math.exp(0.1))
    # kl=0.25: exponent -0.05 -> 0.1 * e^0.05
    assert ctl.update(0.25, 1) == pytest.approx(0.1 * math.exp(0.05))
    # kl on target: unchanged; an absurd kl is capped at a factor e^20, no overflow
    assert ctl.update(0.5, 1) == pytest.approx(0.1 * math.exp(0.05))
    assert ctl.update(1e9, 1) == pytest.approx(0.1 * math.exp(20.05))


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("fixed", {"beta": 0.2}),
        ("adaptive", {"init_beta": 0.2, "target": 1.0, "horizon": 100}),
        ("exp", {"init_beta": 0.2, "target": 1.0, "rate": 0.2}),
    ],
)
def test_controller_state_round_trips_through_json_and_continues_identically(name, kwargs):
    assert known_kl_controllers() == ["adaptive", "exp", "fixed"]
    ctl = get_kl_controller(name)(**kwargs)
    ctl.update(2.0, 10)
    restored = get_kl_controller(name)(**{**kwargs, **{k: 9.0 for k in kwargs}})
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.state_dict() == ctl.state_dict()
    for kl in (0.3, 1.7, 1.0):
        assert restored.update(kl, 10) == ctl.update(kl, 10)


def test_controller_rejects_nonpositive_target():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="target"):
        ExpKLController(0.1, target=-1.0, rate=0.1)
    with pytest.raises(KeyError, match="adaptive, exp, fixed"):
        get_kl_controller("pid")
