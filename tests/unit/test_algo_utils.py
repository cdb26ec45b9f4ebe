"""Masked reductions, entropy, the LR schedule, registries and the public surface."""

import math

import pytest
import torch

import shardrl.algo as algo
from shardrl.algo import entropy_from_logits, lr_schedule, masked_mean, masked_sum
from shardrl.algo.registry import Registry, UnknownNameError


def test_masked_mean_and_sum():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == 2.0  # (1 + 3) / 2
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), torch.tensor([4.0, 0.0]))
    assert masked_mean(x, torch.zeros(2, 3)).item() == 0.0


def test_entropy_from_logits_in_float32():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    # uniform over 4 -> ln 4; p = [1/4, 3/4] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623
    # (bfloat16 rounds ln 3 to 1.1016, so p is within 1e-3 of [1/4, 3/4])
    assert out[0, 0].item() == pytest.approx(math.log(4.0), rel=1e-6)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert out[0, 1].item() == pytest.approx(expected, abs=2e-3)
    exact = entropy_from_logits(logits)
    assert exact[0, 1].item() == pytest.approx(expected, rel=1e-6)


def test_lr_schedule_values():
    # 111 steps, 0 to 110: steps 0-9 warm up, steps 10-110 decay (p = (step - 10) / 100)
    kw = {"warmup_steps": 10, "total_steps": 111}
    assert lr_schedule(0, **kw) == 0.1  # the first step learns: 1 / 10
    assert lr_schedule(4, **kw) == 0.5  # linear warmup 5 / 10
    assert lr_schedule(9, **kw) == 1.0  # the warmup's last step
    assert lr_schedule(10, **kw) == 1.0
    assert lr_schedule(500, **kw) == 1.0  # constant
    cos = {**kw, "kind": "cosine", "min_ratio": 0.1}
    assert lr_schedule(4, **cos) == 0.5
    assert lr_schedule(10, **cos) == pytest.approx(1.0)
    # halfway through the decay: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55
    assert lr_schedule(60, **cos) == pytest.approx(0.55)
    # a quarter: 0.1 + 0.9 * (1 + cos(pi / 4)) / 2
    assert lr_schedule(35, **cos) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert lr_schedule(110, **cos) == pytest.approx(0.1)  # the run's last step
    assert lr_schedule(1000, **cos) == pytest.approx(0.1)
    assert lr_schedule(0, warmup_steps=0, total_steps=10) == 1.0
    # no decay steps left after the warmup: the floor from then on
    assert lr_schedule(2, warmup_steps=2, total_steps=3, kind="cosine", min_ratio=0.1) == 0.1
    with pytest.raises(ValueError, match="constant, cosine"):
        lr_schedule(0, warmup_steps=0, total_steps=10, kind="linear")


def test_registry_errors_and_duplicates():
    reg: Registry = Registry("widget")
    reg.register("b")(len)
    reg.register("a")(abs)
    assert reg.names() == ["a", "b"] and reg.get("a") is abs
    with pytest.raises(UnknownNameError) as err:
        reg.get("c")
    assert str(err.value) == "unknown widget 'c'; known: a, b"
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)


def test_public_surface_is_exported():
    required = [
        "policy_loss",
        "register_policy_loss",
        "get_policy_loss",
        "known_policy_losses",
        "aggregate",
        "get_aggregation",
        "known_aggregations",
        "group_advantages",
        "gae",
        "register_advantage_estimator",
        "get_advantage_estimator",
        "known_advantage_estimators",
        "kl_penalty",
        "kl_stats",
        "register_kl_estimator",
        "get_kl_estimator",
        "known_kl_estimators",
        "FixedKLController",
        "AdaptiveKLController",
        "ExpKLController",
        "RunningMoments",
        "shape_rewards",
        "value_loss",
        "zero_variance_keep",
        "PassRateTracker",
        "entropy_from_logits",
        "masked_mean",
        "masked_whiten",
        "lr_schedule",
    ]
    missing = [name for name in required if name not in algo.__all__]
    assert missing == []
    assert all(hasattr(algo, name) for name in algo.__all__)
