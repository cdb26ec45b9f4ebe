"""Zero-variance filtering and the pass-rate tracker behind No-Positive-Resampling."""

import json

import pytest
import torch

from shardrl.algo import PassRateTracker, zero_variance_keep


def test_zero_variance_keep():
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 2.0 + 1e-7, 0.3, 0.3], dtype=torch.float64
    )
    groups = torch.tensor([4, 4, 4, 8, 8, 1, 2, 2, -9, 10**12])
    # group 4 constant; group 8 has spread 0.5; group 1 is a single sample; group 2 has
    # population std 5e-8 <= 1e-6; -9 and 10**12 are single samples with the same value
    keep = zero_variance_keep(rewards, groups, tol=1e-6)
    expected = [False, False, False, True, True, False, False, False, False, False]
    assert keep.tolist() == expected
    assert keep.dtype == torch.bool
    assert zero_variance_keep(rewards, groups, tol=1e-8)[6:8].tolist() == [True, True]


def test_pass_rate_window_and_retirement():
    tracker = PassRateTracker(window=4, retire_at=0.75, min_samples=3)
    tracker.update(["a", "a"], [True, True])
    assert tracker.pass_rate("a") == 1.0
    assert tracker.retired() == set()  # 2 samples < min_samples
    tracker.update(["a"], [False])
    assert tracker.pass_rate("a") == pytest.approx(2 / 3)
    assert tracker.retired() == set()
    assert tracker.update(["a"], torch.tensor([True])) == {"a"}
    assert tracker.pass_rate("a") == 0.75  # [T, T, F, T]
    assert tracker.retired() == {"a"}
    assert tracker.update(["a", "b", "b", "b"], torch.tensor([0, 1, 1, 1])) == {"b"}
    # window of 4 drops the oldest T: a -> [T, F, T, F] = 0.5, but a retirement is for good
    # (samples generated before the rollout saw it retire still arrive); b -> [T, T, T]
    assert tracker.pass_rate("a") == 0.5
    assert tracker.retired() == {"a", "b"}
    assert tracker.update(["b"], [True]) == set()  # retired already
    assert tracker.pass_rate("never-seen") is None
    with pytest.raises(ValueError, match="outcomes"):
        tracker.update(["a", "b"], [True])


def test_pass_rate_state_round_trips_through_json():
    tracker = PassRateTracker(window=3, retire_at=0.6, min_samples=2)
    tracker.update(["p1", "p2", "p1", "p1", "p1"], [True, False, True, False, True])
    restored = PassRateTracker(window=100, retire_at=0.9, min_samples=8)  # load replaces them
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert restored.state_dict() == tracker.state_dict()
    assert restored.retired() == tracker.retired() == {"p1"}  # last 3 of p1: T, F, T
    restored.update(["p1"], [False])
    assert restored.pass_rate("p1") == pytest.approx(1 / 3)  # window still 3: F, T, F
    # the retirement outlives the history that caused it, through a save and load too
    again = PassRateTracker(window=3, retire_at=0.6, min_samples=2)
    again.load_state_dict(json.loads(json.dumps(restored.state_dict())))
    assert again.retired() == {"p1"}
    # a state saved without its retired prompts: those its histories retire
    old = {k: v for k, v in tracker.state_dict().items() if k != "retired"}
    again.load_state_dict(old)
    assert again.retired() == {"p1"}


def test_pass_rate_tracker_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_samples"):
        PassRateTracker(window=4, retire_at=0.9, min_samples=5)
