"""Running reward moments, reward shaping and the value loss."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.algo import RunningMoments, shape_rewards, value_loss

D = torch.float64
finite = st.floats(-1e3, 1e3, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(finite, min_size=1, max_size=20), min_size=1, max_size=6))
def test_running_moments_equal_torch_over_the_concatenation(batches):
    moments = RunningMoments()
    for batch in batches:
        moments.update(torch.tensor(batch, dtype=torch.float32).reshape(-1, 1))
    seen = torch.tensor([x for b in batches for x in b], dtype=torch.float32).double()
    assert moments.count.item() == seen.numel()
    assert moments.mean.item() == pytest.approx(seen.mean().item(), rel=1e-9, abs=1e-9)
    if seen.numel() > 1:
        assert moments.std.item() == pytest.approx(seen.std().item(), rel=1e-7, abs=1e-7)


def test_running_moments_small_counts_and_empty_batches():
    moments = RunningMoments()
    assert moments.mean.item() == 0.0 and moments.std.item() == 1.0
    moments.update(torch.tensor([]))
    moments.update(torch.tensor([3.0]))
    # one value: mean 3, std held at 1 -> normalize only shifts
    assert moments.mean.item() == 3.0 and moments.std.item() == 1.0
    moments.update(torch.tensor([5.0, 7.0]))
    # [3, 5, 7]: mean 5, Bessel std sqrt((4 + 0 + 4) / 2) = 2
    assert moments.mean.item() == 5.0 and moments.std.item() == pytest.approx(2.0)
    out = moments.normalize(torch.tensor([9.0, 1.0], dtype=torch.float32), eps=0.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([2.0, -2.0]))


def test_running_moments_state_round_trip():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 4.0]))
    restored = RunningMoments()
    restored.load_state_dict({k: v.tolist() for k, v in moments.state_dict().items()})
    for extra in (torch.tensor([10.0]), torch.tensor([-3.0, 0.5])):
        moments.update(extra)
        restored.update(extra)
    assert restored.state_dict().keys() == {"count", "mean", "m2"}
    for key, value in moments.state_dict().items():
        assert restored.state_dict()[key].item() == value.item()


def _moments_of(values):
    moments = RunningMoments()
    moments.update(torch.tensor(values))
    return moments


def test_shape_rewards_normalise_then_clip():
    moments = _moments_of([0.0, 2.0, 4.0])  # mean 2, std 2
    reward = torch.tensor([2.0, -4.0, 10.0])
    kl = torch.tensor([1.0, 2.0, 3.0])
    out = shape_rewards(reward, kl, moments=moments, clip=3.0, alpha=2.0, beta=0.1)
    # norm -> [0, -3, 4]; clip +-3 -> [0, -3, 3]; 2 r - 0.1 kl -> [-0.1, -6.2, 5.7]
    torch.testing.assert_close(out, torch.tensor([-0.1, -6.2, 5.7]))


def test_shape_rewards_clip_before_norm():
    moments = _moments_of([0.0, 2.0, 4.0])
    reward = torch.tensor([2.0, -4.0, 10.0])
    kl = torch.tensor([1.0, 2.0, 3.0])
    out = shape_rewards(
        reward, kl, moments=moments, clip=3.0, alpha=2.0, beta=0.1, clip_before_norm=True
    )
    # clip -> [2, -3, 3]; norm -> [0, -2.5, 0.5]; 2 r - 0.1 kl -> [-0.1, -5.2, 0.7]
    torch.testing.assert_close(out, torch.tensor([-0.1, -5.2, 0.7]))
    assert moments.count.item() == 3  # read, never updated


def test_shape_rewards_defaults_and_kl_is_never_normalised():
    reward = torch.tensor([1.5, -2.0])
    kl = torch.tensor([10.0, 20.0])
    torch.testing.assert_close(shape_rewards(reward, kl), reward)  # alpha 1, beta 0
    # tensor beta from a controller: r - beta * kl = [1.5 - 5, -2 - 10]
    out = shape_rewards(reward, kl, beta=torch.tensor(0.5))
    torch.testing.assert_close(out, torch.tensor([-3.5, -12.0]))


def test_value_loss_with_and_without_clipping():
    values = torch.tensor([[1.0, 2.0, 1.0, 7.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[1.2, 1.0, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[1.5, 1.0, 1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    loss, metrics = value_loss(values, old, returns, mask)
    # 0.5 (v - R)^2 = [0.125, 0.5, 0, (pad) 0]
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.5, 0.0, 0.0]], dtype=D))
    assert metrics["vf_clip_frac"].item() == 0.0
    loss, metrics = value_loss(values, old, returns, mask, clip_range=0.2)
    # clipped v = old + clamp(v - old, +-0.2) = [1.0, 1.2, 0.2]
    # token 0: max(0.125, 0.5 * 0.25 = 0.125) = 0.125; token 1: max(0.5, 0.5 * 0.04) = 0.5
    # token 2: max(0, 0.5 * 0.64 = 0.32) = 0.32, the clipped term strictly larger
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.5, 0.32, 0.0]], dtype=D))
    assert metrics["vf_clip_frac"].item() == pytest.approx(1 / 3)
    loss.sum().backward()
    # gradients: token 0 tie -> (v - R) = -0.5; token 1: 1.0; token 2 clipped: 0
    torch.testing.assert_close(values.grad, torch.tensor([[-0.5, 1.0, 0.0, 0.0]], dtype=D))
