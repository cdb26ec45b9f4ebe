"""Reward shaping for RLHF: running reward statistics, normalization, clipping, KL term.

`reward_total = alpha * reward_rm_norm - beta * kl_seq`: the reward model's score is
normalised with running moments and clipped, the KL is never normalised (seed 003).
"""

from __future__ import annotations

import torch
from torch import Tensor


class RunningMoments:
    """Exact mean and Bessel-corrected std of every value seen, merged batch by batch.

    Batches merge with Chan et al.'s parallel update in float64, so `.mean` and `.std`
    equal torch.mean / torch.std of the concatenation of all batches. With no value yet
    the mean is 0, and with fewer than two values the std is 1 (so `normalize` only shifts).
    """

    def __init__(self) -> None:
        self.count = torch.zeros((), dtype=torch.float64)
        self._mean = torch.zeros((), dtype=torch.float64)
        self._m2 = torch.zeros((), dtype=torch.float64)  # sum of squared deviations

    def update(self, x: Tensor) -> None:
        """Merge all elements of `x` (any shape) into the statistics."""
        values = x.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        n_b = values.numel()
        if n_b == 0:
            return
        mean_b = values.mean()
        m2_b = (values - mean_b).square().sum()
        total = self.count + n_b
        delta = mean_b - self._mean
        self._mean = self._mean + delta * (n_b / total)
        self._m2 = self._m2 + m2_b + delta.square() * (self.count * n_b / total)
        self.count = total

    @property
    def mean(self) -> Tensor:
        """Mean of all values seen, 0-dim float64."""
        return self._mean

    @property
    def std(self) -> Tensor:
        """Bessel-corrected std of all values seen, 0-dim float64 (1 below two values)."""
        var = self._m2 / (self.count - 1.0).clamp_min(1.0)
        return torch.where(self.count > 1, var.sqrt(), torch.ones_like(var))

    def normalize(self, x: Tensor, eps: float = 1e-8) -> Tensor:
        """(x - mean) / (std + eps), in the dtype and device of x."""
        mean = self._mean.to(device=x.device, dtype=x.dtype)
        std = self.std.to(device=x.device, dtype=x.dtype)
        return (x - mean) / (std + eps)

    def state_dict(self) -> dict[str, Tensor]:
        """Count, mean and sum of squared deviations (0-dim float64 tensors)."""
        return {"count": self.count.clone(), "mean": self._mean.clone(), "m2": self._m2.clone()}

    def load_state_dict(self, state: dict[str, Tensor | float]) -> None:
        """Restore from `state_dict()` (tensors or plain numbers)."""
        self.count, self._mean, self._m2 = (
            torch.as_tensor(state[k], dtype=torch.float64).clone() for k in ("count", "mean", "m2")
        )


def normalized_scores(reward_rm: Tensor, clip: float | None, clip_before_norm: bool) -> Tensor:
    """The scores `shape_rewards` normalises, which the running statistics must describe:
    `reward_rm` itself, or clipped to +-clip first when `clip_before_norm`. (Statistics of
    the unclipped scores would shift and shrink the clipped ones: rewards [0, 0, 100, 100]
    clipped to 5 would all come out negative, 20 times closer together.) (B,) -> (B,)."""
    if clip is not None and clip_before_norm:
        return reward_rm.clamp(-clip, clip)
    return reward_rm


def shape_rewards(
    reward_rm: Tensor,
    kl_seq: Tensor,
    *,
    moments: RunningMoments | None = None,
    clip: float | None = None,
    alpha: float = 1.0,
    beta: float | Tensor = 0.0,
    clip_before_norm: bool = False,
) -> Tensor:
    """Total reward `alpha * r - beta * kl_seq`, r the reward-model score after shaping.

    reward_rm, kl_seq: (B,). r is normalised with `moments` (if given; they are read, not
    updated: update them first with `normalized_scores` if this batch should count) and
    clipped to +-clip (if given), clipping first when `clip_before_norm`. The KL is never
    normalised. Returns (B,).
    """
    r = normalized_scores(reward_rm, clip, clip_before_norm)
    if moments is not None:
        r = moments.normalize(r)
    if clip is not None and not clip_before_norm:
        r = r.clamp(-clip, clip)
    return alpha * r - beta * kl_seq
