"""One learner update: the loss of a batch through the algorithm registries, then the step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..algo import (
    aggregate,
    get_advantage_estimator,
    kl_penalty,
    kl_stats,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from ..config import RunConfig
from ..models.heads import token_logprobs
from .batch import SeqBatch, build_batch, padded_column


@dataclass
class StepResult:
    applied: bool
    """False when the loss or a gradient was non-finite and the step was skipped."""
    metrics: dict[str, float]
    kl_sum_mean: float


def loss_params(cfg: RunConfig) -> dict:
    """The configured surrogate's parameters (everything but its name)."""
    return cfg.algo.loss.model_dump(exclude={"kind"})


def group_index(table: pa.Table) -> torch.Tensor:
    ids = table.column("group_id").to_numpy(zero_copy_only=False)
    return torch.from_numpy(np.unique(ids, return_inverse=True)[1].astype(np.int64))  # (B,)


def compute_loss(cfg: RunConfig, model, table: pa.Table, pad_id: int, beta: float,
                 critic=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], SeqBatch]:
    """Total loss (scalar) and detached metrics for the kept rows in `table`."""
    algo = cfg.algo
    batch = build_batch(table, pad_id)
    mask = batch.response_mask  # (B, T)
    groups = group_index(table)  # (B,)
    out = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_start,
                         temperature=cfg.rollout.temperature, fp32_lm_head=cfg.model.fp32_lm_head)
    logprobs = out.logprobs  # (B, T)
    old = batch.pad_response(padded_column(table, "behavior_logprobs"))  # (B, T)
    metrics: dict[str, torch.Tensor] = {}
    values = None
    if algo.advantages.estimator == "gae":
        values = critic.response_values(batch.input_ids, batch.attention_mask,
                                        batch.response_start)[:, : batch.width]  # (B, T)
        rewards = torch.from_numpy(table.column("reward_total").to_numpy().astype(np.float32))
        if algo.kl.placement == "reward":  # per-token KL penalty, reward on the last token
            ref = batch.pad_response(padded_column(table, "ref_logprobs"))
            token_rewards = -beta * kl_penalty(old, ref, algo.kl.estimator) * mask  # (B, T)
            last = (batch.response_lengths - 1).clamp_min(0)[:, None]
            rm_only = torch.from_numpy(table.column("reward_rm").to_numpy().astype(np.float32))
            rewards = token_rewards.scatter_add(1, last, rm_only[:, None])  # (B, T)
        adv, returns = get_advantage_estimator("gae")(
            rewards, mask, values=values.detach(), gamma=algo.advantages.gamma,
            lam=algo.advantages.lam)
        if algo.advantages.whiten:
            adv = masked_whiten(adv, mask)
    else:
        adv = torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32))  # (B,)
    per_token, pl_metrics = policy_loss(algo.loss.kind, logprobs, old, adv, mask,
                                        **loss_params(cfg))
    loss = aggregate(per_token, mask, algo.aggregation, groups)
    metrics.update({k: v.detach() for k, v in pl_metrics.items()})
    metrics["policy_loss"] = loss.detach()
    if table.column("ref_logprobs").null_count == 0 and algo.kl.placement != "none":
        ref = batch.pad_response(padded_column(table, "ref_logprobs"))
        kl_tok = kl_penalty(logprobs, ref, algo.kl.estimator) * mask  # (B, T)
        stats = kl_stats(kl_tok.detach(), mask)
        metrics["kl_sum"], metrics["kl_mean"] = stats.kl_sum.mean(), stats.kl_mean.mean()
        if algo.kl.placement == "loss":
            loss = loss + beta * aggregate(kl_tok, mask, algo.aggregation, groups)
    entropy = masked_mean(out.entropy, mask)
    metrics["entropy"] = entropy.detach()
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * entropy
    if values is not None:
        old_values = values.detach()
        vl, vmetrics = value_loss(values, old_values, returns, mask,
                                  clip_range=algo.critic.clip_range)
        vloss = aggregate(vl, mask, "token")
        loss = loss + algo.critic.vf_coef * vloss
        metrics["value_loss"] = vloss.detach()
        metrics.update({k: v.detach() for k, v in vmetrics.items()})
    adv_valid = adv if adv.dim() == 1 else adv[mask > 0]
    metrics["advantage_abs_max"] = (adv_valid.abs().max().detach() if adv_valid.numel()
                                    else torch.zeros(()))  # no response token in the batch
    metrics["total_loss"] = loss.detach()
    return loss, metrics, batch


def apply_step(loss: torch.Tensor, params: list[torch.nn.Parameter], optimizers,
               grad_clip: float | None) -> tuple[bool, float]:
    """Backward, clip and step; skips (and reports False) on a non-finite loss or gradient."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False, math.nan
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else math.inf)
    if not torch.isfinite(norm):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return False, float(norm)
    for opt in optimizers:
        opt.step()
    return True, float(norm)
