"""Critic (value head) loss for PPO with GAE, with optional value clipping."""

from __future__ import annotations

import torch
from torch import Tensor

from shardrl.algo.utils import as_weights


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token value loss `0.5 * (v - R)**2`, zero where mask is 0.

    values, old_values, returns, mask: (B, T). With `clip_range` c the loss is
    `0.5 * max((v - R)**2, (old + clamp(v - old, -c, c) - R)**2)`. Metric `vf_clip_frac`:
    share of response tokens where the clipped term is strictly larger (0 without clipping).
    Reduce the result with `aggregate`.
    """
    m = as_weights(mask, values)
    loss = 0.5 * (values - returns).square()  # (B, T)
    n = m.sum().clamp_min(1.0)
    if clip_range is None:
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped_loss = 0.5 * (clipped_values - returns).square()
        clip_frac = ((clipped_loss > loss).detach() * m).sum() / n
        loss = torch.maximum(loss, clipped_loss)
    return loss * m, {"vf_clip_frac": clip_frac}
