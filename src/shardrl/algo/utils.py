"""Masked reductions, whitening, entropy and group bookkeeping shared by the algorithms.

Masks are 0/1 tensors (bool or floating) marking response tokens. Reductions over an empty
mask return 0, never NaN: the denominators are clamped to at least one token.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Log importance ratios are clamped to +-this before `exp`: exp(20) ~ 4.9e8 cannot overflow,
and no ratio met in training comes near it, so results in the normal range are unchanged."""


def as_weights(mask: Tensor, like: Tensor) -> Tensor:
    """The 0/1 `mask` in the floating dtype of `like` (no copy when it already is)."""
    return mask.to(dtype=like.dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x * mask` over `dim` (all elements when None)."""
    xm = x * as_weights(mask, x)
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is 1, along `dim` (all when None).

    x, mask: (B, T) or any equal shapes. Returns 0 where the mask selects nothing.
    """
    m = as_weights(mask, x)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Whiten `x` with the mean and Bessel-corrected std of its masked entries.

    x, mask: (B, T). Returns (x - mean) / sqrt(var + eps), the mean added back when
    `shift_mean` is False; zero where mask is 0.
    """
    m = as_weights(mask, x)
    n = m.sum()
    mean = (x * m).sum() / n.clamp_min(1.0)
    var = ((x - mean).square() * m).sum() / (n - 1.0).clamp_min(1.0)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last axis, computed in float32.

    logits: (B, T, V). Returns (B, T) float32.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    # -inf logits (masked vocabulary) give p = 0: clamp so 0 * log p is 0, not NaN
    finite_logp = logp.clamp_min(torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite_logp).sum(-1)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary int64 group ids to dense indices.

    group_ids: (B,). Returns (index (B,) in 0..G-1, G).
    """
    uniques, index = torch.unique(group_ids, return_inverse=True)
    return index, uniques.numel()


def group_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """Per-group sums of `values` (B,) by dense `index` (B,). Returns (G,)."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add(0, index, values)
