"""Advantage estimators: group-relative (GRPO/ScaleRL style) and GAE with a critic.

`group_advantages` and `gae` are the functions of the math. The registry holds them behind
one signature, so a caller resolves the configured name and passes what it has:
    fn(rewards, mask, *, group_ids=None, values=None, **params) -> (advantages, returns)
with rewards (B,) per sample or (B, T) per token, mask (B, T), and both outputs (B, T),
zero where mask is 0. Estimates are constants for the loss: no gradient flows through them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shardrl.algo.registry import Registry, unknown_name
from shardrl.algo.utils import as_weights, group_index, group_sum, masked_sum

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

ADVANTAGE_NORMS = ("batch", "none", "prompt")


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an advantage estimator with the family signature under `name`."""
    return _ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name` (error listing the known names otherwise)."""
    return _ESTIMATORS.get(name)


def known_advantage_estimators() -> list[str]:
    """Names of the registered advantage estimators, sorted."""
    return _ESTIMATORS.names()


def known_advantage_norms() -> list[str]:
    """Normalizations accepted by `group_advantages`, sorted."""
    return list(ADVANTAGE_NORMS)


def batch_normalize(a: Tensor, eps: float = 1e-6) -> Tensor:
    """a / (std(a) + eps) over all of `a` (Bessel-corrected; std 0 for one element). (B,)"""
    std = a.std() if a.numel() > 1 else torch.zeros((), dtype=a.dtype, device=a.device)
    # the floor only matters for eps=0 and zero spread, where a is 0: 0, not 0/0
    return a / (std + eps).clamp_min(torch.finfo(a.dtype).tiny)


def shard_norm(norm: str) -> str:
    """The normalization prepare applies to a shard's group advantages for the configured
    `norm`: "batch" is ScaleRL's normalization over the learner's batch, which prepare does
    not know, so prepare only centers ("none") and the learner divides by the batch std."""
    return "none" if norm == "batch" else norm


def group_advantages(rewards: Tensor, group_ids: Tensor, norm: str, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages `a = r - mean_of_group(r)`, optionally normalised.

    rewards: (B,); group_ids: (B,) int64, any values. `norm`: "none" gives a; "prompt"
    gives a / (std_of_group(r) + eps); "batch" gives a / (std(a over the batch) + eps).
    std is Bessel-corrected; a group of one sample has advantage 0. Returns (B,).
    """
    if norm not in ADVANTAGE_NORMS:
        raise unknown_name("advantage normalization", norm, known_advantage_norms())
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    index, num_groups = group_index(group_ids)
    counts = group_sum(torch.ones_like(r), index, num_groups)  # (G,)
    means = group_sum(r, index, num_groups) / counts  # (G,)
    a = r - means[index]  # (B,); exactly 0 for a group of one
    if norm == "none":
        return a
    if norm == "batch":
        return batch_normalize(a, eps)
    variances = group_sum(a.square(), index, num_groups) / (counts - 1.0).clamp_min(1.0)
    std = variances.sqrt()[index]  # (B,)
    return a / (std + eps).clamp_min(torch.finfo(a.dtype).tiny)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), no whitening.

    rewards, values, mask: (B, T), right-padded. `delta_t = r_t + gamma*V_{t+1} - V_t` and
    `A_t = delta_t + gamma*lam*A_{t+1}`, with V and A taken as 0 after a sample's last
    response token. Returns (advantages (B, T), returns = advantages + values (B, T)), both
    zero where mask is 0. Whiten separately with `masked_whiten` if wanted.

    The recursion runs over the positions where mask is 1 only: in a multi-turn episode the
    environment's tokens (mask 0) between two policy turns are skipped, so "t+1" is the next
    token the policy generated, and rewards placed on masked positions are ignored.
    """
    with torch.no_grad():
        m = as_weights(mask, values)
        keep = m > 0  # (B, T)
        r = rewards.detach() * m
        v = values.detach() * m
        next_value = torch.zeros_like(v[:, 0])  # (B,)
        next_adv = torch.zeros_like(v[:, 0])  # (B,)
        steps: list[Tensor] = []
        for t in range(v.shape[1] - 1, -1, -1):
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv = delta + gamma * lam * next_adv
            next_adv = torch.where(keep[:, t], adv, next_adv)  # masked: carried across
            next_value = torch.where(keep[:, t], v[:, t], next_value)
            steps.append(adv * m[:, t])
        advantages = torch.stack(steps[::-1], dim=1)  # (B, T)
        return advantages, (advantages + v) * m


def last_masked(mask: Tensor) -> Tensor:
    """(B, T) -> (B,) int64: each row's last position where mask is nonzero (0 for none):
    a single response's last token, a multi-turn episode's last policy token."""
    width = mask.shape[-1]
    if width == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    on = mask != 0  # (B, T)
    last = width - 1 - on.flip(-1).int().argmax(-1)  # (B,)
    return torch.where(on.any(-1), last, torch.zeros_like(last))


@register_advantage_estimator("group")
def _group_estimator(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    norm: str = "none",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """`group_advantages` broadcast over each sample's response tokens; `values` is unused.

    rewards: (B,), or (B, T) summed over response tokens. Returns (advantages, advantages):
    without a critic there is no separate return target.
    """
    if group_ids is None:
        raise ValueError("advantage estimator 'group' needs group_ids (B,)")
    per_sample = rewards if rewards.dim() == 1 else masked_sum(rewards, mask, dim=-1)  # (B,)
    adv = group_advantages(per_sample, group_ids, norm, eps)  # (B,)
    adv = adv.unsqueeze(-1) * as_weights(mask, adv)  # (B, T)
    return adv, adv


@register_advantage_estimator("gae")
def _gae_estimator(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """`gae` on token rewards; `group_ids` is unused.

    rewards: (B, T), or (B,) placed on each sample's last token where mask is 1. values: (B, T).
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (B, T)")
    if rewards.dim() == 1:
        last = last_masked(mask).unsqueeze(-1)  # (B, 1)
        per_sample = rewards.to(values.dtype).unsqueeze(-1)  # (B, 1)
        rewards = torch.zeros_like(values).scatter(1, last, per_sample)  # (B, T)
    return gae(rewards, values, mask, gamma, lam)
