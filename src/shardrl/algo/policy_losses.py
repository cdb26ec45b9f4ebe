"""Policy-gradient surrogates, registered by name: `cispo`, `ppo`, `gspo`, `dppo_tv`, `dppo_kl`.

One signature for the family:
    fn(logprobs, old_logprobs, advantages, mask, **params) -> (per_token_loss, metrics)
with logprobs, old_logprobs, mask (B, T), advantages (B,) or (B, T). `per_token_loss` (B, T)
is the quantity to minimise, zero where mask is 0 (padded positions must hold finite
values); reduce it with `aggregate`. `metrics` holds detached 0-dim tensors: `clip_frac`,
`ratio_mean` and `approx_kl` (k3 estimate of KL(old || new) from the behaviour samples,
mean over response tokens). The importance ratio is `exp(logprobs - old_logprobs)`, its
log clamped to +-LOG_RATIO_CLAMP.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from shardrl.algo.registry import Registry
from shardrl.algo.utils import LOG_RATIO_CLAMP, as_weights, masked_mean

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss with the family signature under `name`."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name` (error listing the known names otherwise)."""
    return _POLICY_LOSSES.get(name)


def known_policy_losses() -> list[str]:
    """Names of the registered policy losses, sorted."""
    return _POLICY_LOSSES.names()


def policy_loss(
    kind: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **params: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss (B, T) and metrics of the registered policy loss `kind`."""
    return get_policy_loss(kind)(logprobs, old_logprobs, advantages, mask, **params)


def _per_token(advantages: Tensor) -> Tensor:
    """Advantages (B,) or (B, T) as a tensor broadcasting against (B, T)."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _ratio_metrics(
    ratio: Tensor, token_ratio: Tensor, token_log_ratio: Tensor, m: Tensor
) -> dict[str, Tensor]:
    """`ratio_mean` of `ratio` and `approx_kl` (k3 with r = new/old: r - 1 - log r).

    All inputs (B, T) and detached; means over the response tokens of `m`.
    """
    n = m.sum().clamp_min(1.0)
    k3 = token_ratio - token_log_ratio - 1.0  # (B, T), >= 0
    return {"ratio_mean": (ratio * m).sum() / n, "approx_kl": (k3 * m).sum() / n}


@register_policy_loss("cispo")
def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    max_ratio: float | None = 4.0,
    min_ratio: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1; ScaleRL): `-sg(clamp(ratio, min_ratio, max_ratio)) * A * logprobs`.

    The weight is detached, so every token keeps the gradient `-w * A` through `logprobs`;
    no token is dropped. `clip_frac` is the share of response tokens where the clamp acts.
    """
    m = as_weights(mask, logprobs)  # (B, T)
    adv = _per_token(advantages)  # (B, 1) or (B, T)
    with torch.no_grad():
        log_ratio = (logprobs.detach() - old_logprobs).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()  # (B, T)
        bounded = min_ratio is not None or max_ratio is not None
        weight = ratio.clamp(min_ratio, max_ratio) if bounded else ratio
        coef = (weight * adv).mul_(m).neg_()  # (B, T): -w * A on response tokens, else 0
        n = m.sum().clamp_min(1.0)
        metrics = {"clip_frac": ((weight != ratio) * m).sum() / n}
        metrics.update(_ratio_metrics(ratio, ratio, log_ratio, m))
    return coef * logprobs, metrics


def _clipped_surrogate(
    logprobs: Tensor,
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss `-min(r * A, clamp(r, 1-eps_low, 1+eps_high) * A)`, masked.

    ratio: (B, T) detached values of a ratio whose derivative with respect to each token's
    log-probability is the ratio itself (true of exp(logprobs - old_logprobs) and of GSPO's
    per-token ratio); adv broadcasts to (B, T); m: (B, T) weights. With `dual_clip` c > 1
    the loss of tokens with A < 0 is capped at -c * A.

    The loss value is computed without autograd and its exact gradient is attached as
    `value + coef * (logprobs - sg(logprobs))`: `coef` is -A * r where the unclipped term is
    taken and 0 where a clip acts. This equals autograd through the formula (tested) at half
    the cost of differentiating two clamps and a max. Clip fractions use strict comparisons,
    so ties count as unclipped.
    """
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        unclipped = -adv * ratio  # (B, T)
        clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T)
        is_clipped = clipped > unclipped
        value = torch.maximum(unclipped, clipped)
        coef = unclipped.masked_fill_(is_clipped, 0.0)  # d loss / d logprob
        metrics = {"clip_frac": (is_clipped * m).sum() / n}
        if dual_clip is not None:
            if dual_clip <= 1.0:
                raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
            cap = -dual_clip * adv
            capped = (adv < 0) & (cap < value)
            value = torch.where(capped, cap, value)
            coef.masked_fill_(capped, 0.0)
            metrics["dual_clip_frac"] = (capped * m).sum() / n
        value.mul_(m)
        coef.mul_(m)
    return value + coef * (logprobs - logprobs.detach()), metrics


@register_policy_loss("ppo")
def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip and optional dual clip.

    Tokens whose clipped (or dual-clip) term wins get no gradient; `clip_frac` is the share
    of the clipped ones (`dual_clip_frac` that of the capped ones when `dual_clip` is set).
    """
    m = as_weights(mask, logprobs)  # (B, T)
    with torch.no_grad():
        log_ratio = (logprobs.detach() - old_logprobs).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()  # (B, T)
    loss, metrics = _clipped_surrogate(
        logprobs, ratio, _per_token(advantages), m, eps_low, eps_high, dual_clip
    )
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, ratio, log_ratio, m))
    return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clipped form on the sequence ratio.

    `s_i = exp(mean over response tokens of (logprobs - old_logprobs))`; each token uses
    `sg(s_i) * exp(logprobs - sg(logprobs))`, whose value is s_i and whose derivative with
    respect to the token's log-probability is s_i, so a sample's gradient under "sample"
    aggregation is that of its sequence ratio. Advantages are per sample: (B,), or (B, T)
    reduced by their mean over response tokens.
    """
    m = as_weights(mask, logprobs)  # (B, T)
    adv = advantages if advantages.dim() == 1 else masked_mean(advantages, mask, dim=-1)  # (B,)
    with torch.no_grad():
        token_log_ratio = (logprobs.detach() - old_logprobs).clamp_(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )  # (B, T)
        seq_log_ratio = (token_log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1.0)  # (B,)
        ratio = seq_log_ratio.exp().unsqueeze(-1).expand_as(m)  # (B, T), s_i on every token
    loss, metrics = _clipped_surrogate(
        logprobs, ratio, adv.unsqueeze(-1), m, eps_low, eps_high, None
    )
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, token_log_ratio.exp(), token_log_ratio, m))
    return loss, metrics


def binary_kl(q: Tensor, p: Tensor, eps: float = 1e-8) -> Tensor:
    """KL(Bernoulli(q) || Bernoulli(p)) elementwise: q log(q/p) + (1-q) log((1-q)/(1-p))."""
    return (q * (torch.log(q + eps) - torch.log(p + eps))
            + (1.0 - q) * (torch.log(1.0 - q + eps) - torch.log(1.0 - p + eps)))


_TOKEN_DIVERGENCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "tv": lambda p, q: (p - q).abs(),
    "kl": lambda p, q: binary_kl(q, p),
}
"""DPPO's divergences between the old (q) and new (p) distributions over {the sampled
token, anything else}: total variation |p - q| and KL(Bernoulli(q) || Bernoulli(p))."""


def dppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    divergence: str,
    delta_low: float,
    delta_high: float,
    max_ratio: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO ("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879),
    registered as `dppo_tv` and `dppo_kl` (`divergence` tv or kl).

    PPO's ratio clip treats a rare token whose probability goes from 1e-5 to 1e-3 (ratio
    100) as a large step and a drop from 0.99 to 0.80 (ratio 0.8) as a small one. DPPO bounds
    the divergence between the old and new distributions over {sampled token, anything
    else} instead (`_TOKEN_DIVERGENCES`), with p = pi(token) and q = pi_old(token). A token
    whose probability already rose (advantage > 0) or fell (advantage < 0) by a divergence
    over `delta_high` / `delta_low` gets no gradient; every other token has CISPO's update
    `-sg(min(ratio, max_ratio)) * A * logprobs`. `clip_frac`: the share of masked tokens.
    """
    outside = _TOKEN_DIVERGENCES[divergence]
    m = as_weights(mask, logprobs)  # (B, T)
    adv = _per_token(advantages).expand_as(m)  # (B, T)
    with torch.no_grad():
        log_ratio = (logprobs.detach() - old_logprobs).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()  # (B, T)
        p, q = logprobs.detach().exp(), old_logprobs.exp()  # (B, T) new and old token probs
        d = outside(p, q)  # (B, T)
        # the probability moved past the region in the direction the advantage pushes it
        up = (adv > 0) & (p > q) & (d > delta_high)
        down = (adv < 0) & (p < q) & (d > delta_low)
        kept = ~(up | down)
        coef = (ratio.clamp(max=max_ratio) * adv * kept).mul_(m).neg_()  # (B, T)
        n = m.sum().clamp_min(1.0)
        metrics = {"clip_frac": ((~kept) * m).sum() / n}
        metrics.update(_ratio_metrics(ratio, ratio, log_ratio, m))
    return coef * logprobs, metrics


dppo_tv_loss = register_policy_loss("dppo_tv")(partial(dppo_loss, divergence="tv"))
dppo_kl_loss = register_policy_loss("dppo_kl")(partial(dppo_loss, divergence="kl"))
