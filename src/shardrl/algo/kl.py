"""KL to the frozen reference: per-token estimators (registered `k1`, `k2`, `k3`) and the
per-sequence statistics `kl_sum` / `kl_mean` (Schulman, "Approximating KL divergence").

With `d = logprobs - ref_logprobs` on tokens sampled from the policy:
`k1 = d` (unbiased, can be negative), `k2 = d**2 / 2` (low variance, biased),
`k3 = exp(-d) - 1 + d` (unbiased, always >= 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from shardrl.algo.registry import Registry
from shardrl.algo.utils import LOG_RATIO_CLAMP, as_weights

KLEstimator = Callable[[Tensor, Tensor], Tensor]

_KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator registering a per-token KL estimator `fn(logprobs, ref_logprobs)`."""
    return _KL_ESTIMATORS.register(name)


def get_kl_estimator(name: str) -> KLEstimator:
    """The KL estimator registered as `name` (error listing the known names otherwise)."""
    return _KL_ESTIMATORS.get(name)


def known_kl_estimators() -> list[str]:
    """Names of the registered KL estimators, sorted."""
    return _KL_ESTIMATORS.names()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate (B, T) of the registered estimator `kind`.

    Positions outside the response are not masked here: the caller applies its mask
    (`kl_stats` does).
    """
    return get_kl_estimator(kind)(logprobs, ref_logprobs)


@register_kl_estimator("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = d. Shapes (B, T)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = d**2 / 2. Shapes (B, T)."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl_estimator("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(-d) - 1 + d. Shapes (B, T). Below d = -LOG_RATIO_CLAMP, where exp(-d) would
    overflow, d is held at the clamp in both terms: the value stays finite and the gradient is
    0 there (clamping inside the exp alone would leave the `+ d` term's gradient of +1, which
    pushes a token the policy has already dropped far below the reference further down).
    Above it exp(-d) only underflows to 0: value and gradient are exact."""
    d = (logprobs - ref_logprobs).clamp(min=-LOG_RATIO_CLAMP)
    return torch.exp(-d) - 1.0 + d


class KLStats(NamedTuple):
    """Per-sequence KL statistics, each (B,)."""

    kl_sum: Tensor
    """Sum of the per-token KL over the response tokens."""
    kl_mean: Tensor
    """kl_sum divided by the number of response tokens (0 for an empty response)."""


def kl_stats(kl_tokens: Tensor, mask: Tensor) -> KLStats:
    """Sequence KL from per-token estimates. kl_tokens, mask: (B, T). Returns (B,) each."""
    m = as_weights(mask, kl_tokens)
    kl_sum = (kl_tokens * m).sum(-1)  # (B,)
    return KLStats(kl_sum=kl_sum, kl_mean=kl_sum / m.sum(-1).clamp_min(1.0))
