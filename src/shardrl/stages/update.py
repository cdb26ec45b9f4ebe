"""One learner update: the loss of a batch through the algorithm registries, then the step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..algo import (
    LOG_RATIO_CLAMP,
    aggregate,
    batch_normalize,
    get_advantage_estimator,
    kl_penalty,
    kl_stats,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from ..algo.advantages import last_masked
from ..config import RunConfig
from ..learner_backends.base import PolicyLogprobs
from .batch import SeqBatch, build_batch, padded_column


def checkpoint_activations(cfg: RunConfig, model: torch.nn.Module) -> None:
    """Turn on `learner.activation_checkpointing` for `model` (transformers' activation
    checkpointing of every decoder layer, non-reentrant) when the config asks for it: what
    the learner trains with, and anything that claims to train as it does."""
    if cfg.learner.activation_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})


def loss_params(cfg: RunConfig) -> dict:
    """The configured surrogate's parameters (everything but its name)."""
    return cfg.algo.loss.model_dump(exclude={"kind"})


def group_index(table: pa.Table) -> torch.Tensor:
    ids = table.column("group_id").to_numpy(zero_copy_only=False)
    return torch.from_numpy(np.unique(ids, return_inverse=True)[1].astype(np.int64))  # (B,)


def logprob_mismatch(behaviour: torch.Tensor, learner_old: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the generator's logprobs are from the learner's on the same tokens.

    behaviour, learner_old, mask: (B, T). Returns detached 0-dim tensors, means over response
    tokens: `logprob_mismatch_abs` = |behaviour - learner_old| and `mismatch_k3` = the k3
    estimate of KL(behaviour || learner_old) from the behaviour samples, r - 1 - log r with
    r = pi_learner_old / pi_behaviour. Both include policy lag when the sample is stale.
    """
    with torch.no_grad():
        log_ratio = (learner_old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        k3 = log_ratio.exp() - 1.0 - log_ratio  # (B, T), >= 0
        return {"logprob_mismatch_abs": masked_mean(log_ratio.abs(), mask),
                "mismatch_k3": masked_mean(k3, mask)}


def truncated_is_weight(learner_old: torch.Tensor, behaviour: torch.Tensor,
                        cap: float) -> torch.Tensor:
    """Token weights min(pi_learner_old / pi_behaviour, cap), detached. All (B, T)."""
    with torch.no_grad():
        log_ratio = (learner_old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return log_ratio.exp().clamp(max=cap)  # (B, T)


def masked_is_weight(learner_old: torch.Tensor, behaviour: torch.Tensor, low: float,
                     cap: float) -> torch.Tensor:
    """IcePop's token weights: k = pi_learner_old / pi_behaviour where low <= k <= cap, 0
    elsewhere; detached. All (B, T)."""
    with torch.no_grad():
        log_ratio = (learner_old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k = log_ratio.exp()  # (B, T)
        return k * ((k >= low) & (k <= cap))


def is_weight(cfg: RunConfig, learner_old: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """The configured behaviour/learner importance weight (`algo.is_correction`), (B, T)."""
    c = cfg.algo.is_correction
    if c.mode == "mask":
        return masked_is_weight(learner_old, behaviour, c.low, c.cap)
    return truncated_is_weight(learner_old, behaviour, c.cap)


def gae_rewards(cfg: RunConfig, table: pa.Table, batch: SeqBatch, behaviour: torch.Tensor,
                beta: float) -> torch.Tensor:
    """Per-token rewards for GAE, (B, T).

    The sequence reward is the ready shard's `reward_total` (prepare's shaping: the reward
    model's score normalised and clipped, times alpha; for GAE prepare leaves the KL out of
    it), placed on the last response token the policy generated (of a multi-turn episode:
    its last turn's last token). With `algo.kl.placement: reward` every response
    token also gets `-beta * kl(behaviour || ref)` at the current beta, never normalised
    (the PPO-RLHF reward). behaviour: (B, T) behaviour logprobs, padded like the batch.
    """
    mask = batch.response_mask  # (B, T)
    total = torch.from_numpy(table.column("reward_total").to_numpy().astype(np.float32))  # (B,)
    rewards = torch.zeros_like(mask, dtype=torch.float32)  # (B, T)
    if cfg.algo.kl.placement == "reward":
        ref = batch.pad_response(padded_column(table, "ref_logprobs"))  # (B, T)
        rewards = -beta * kl_penalty(behaviour, ref, cfg.algo.kl.estimator) * mask
    if rewards.shape[1] == 0:  # no response token in the batch
        return rewards
    last = last_masked(mask)[:, None]  # (B, 1)
    return rewards.scatter_add(1, last, total[:, None])


@dataclass
class Share:
    """One micro-batch's part of its whole batch: with it, the micro-batches' losses add up
    to the whole batch's loss. Tensors are the micro-batch's rows at the whole batch's
    response width (cropped to the micro-batch's)."""

    agg: torch.Tensor
    """(b, T) token weights of the configured aggregation over the whole batch."""
    tokens: torch.Tensor
    """(b, T) mask over the whole batch's response-token count (a token mean's weights)."""
    adv: torch.Tensor
    """(b,) advantages, normalized over the whole batch when so configured."""
    token_frac: float
    """The micro-batch's share of the batch's response tokens."""
    sample_frac: float
    """Its share of the batch's samples."""


def aggregation_weights(mask: torch.Tensor, mode: str, groups: torch.Tensor) -> torch.Tensor:
    """(B, T) weights w with aggregate(L, mask, mode, groups) == sum(L * w) for every per-
    token loss L: the aggregation's gradient, exact since every mode is linear in L."""
    x = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        return torch.autograd.grad(aggregate(x, mask, mode, groups), x)[0]


def row_lengths(table: pa.Table) -> np.ndarray:
    """(B,) tokens of each row: prompt plus response."""
    def lengths(column: str) -> np.ndarray:
        return np.diff(table.column(column).combine_chunks().offsets.to_numpy()).astype(np.int64)

    return lengths("prompt_token_ids") + lengths("response_token_ids")


def plan_micro_batches(lengths: np.ndarray, rows: int | None, tokens: int | None,
                       ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(order, parts): the rows in the order to train them and the [start, stop) ranges of
    that order that form the micro-batches, each at most `rows` rows (None: no bound) and
    at most `tokens` padded tokens, rows x its longest row (None: no bound; a row longer
    than that is a micro-batch of its own). With a token bound the rows go shortest first,
    so that a micro-batch pads its rows to nearly their own length; without one they keep
    their order."""
    n = len(lengths)
    order = np.argsort(lengths, kind="stable") if tokens is not None else np.arange(n)
    parts: list[tuple[int, int]] = []
    start = 0
    for i in range(n):  # sorted ascending: row i is the longest of a part ending at it
        size = i - start + 1
        if i > start and ((rows is not None and size > rows) or
                          (tokens is not None and size * int(lengths[order[i]]) > tokens)):
            parts.append((start, i))
            start = i
    if n:
        parts.append((start, n))
    return order, parts


def micro_losses(cfg: RunConfig, policy: PolicyLogprobs, table: pa.Table, pad_id: int,
                 beta: float, parts: int | list[tuple[int, int]],
                 metrics: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
    """The losses of `table`'s micro-batches, one at a time, for gradient accumulation:
    `parts` is [start, stop) row ranges covering the table in order, or an int, ranges of
    that many rows. Their sum is `compute_loss`'s loss of the whole table (up to float
    error) and so is the sum of their gradients. `metrics` receives the whole batch's
    metrics: losses and entropy added up, other means weighted by token (KL: sample) share."""
    rows = len(table)
    if isinstance(parts, int):
        parts = [(first, min(first + parts, rows)) for first in range(0, rows, parts)]
    batch = build_batch(table, pad_id)
    mask = batch.response_mask  # (B, T)
    agg = aggregation_weights(mask, cfg.algo.aggregation, group_index(table))  # (B, T)
    tokens = mask / mask.sum().clamp_min(1.0)  # (B, T)
    adv = torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32))  # (B,)
    if cfg.algo.advantages.norm == "batch":
        adv = batch_normalize(adv)
    total = mask.sum().clamp_min(1.0)
    additive = {"policy_loss", "total_loss", "entropy"}
    for first, stop in parts:
        part = slice(first, stop)
        share = Share(agg=agg[part], tokens=tokens[part], adv=adv[part],
                      token_frac=float(mask[part].sum() / total),
                      sample_frac=(stop - first) / rows)
        loss, m, _ = compute_loss(cfg, policy, table.slice(first, stop - first), pad_id, beta,
                                  share=share)
        for key, value in m.items():
            if key == "advantage_abs_max":
                metrics[key] = torch.maximum(metrics.get(key, value), value)
                continue
            weight = (1.0 if key in additive else
                      share.sample_frac if key in ("kl_sum", "kl_mean") else share.token_frac)
            metrics[key] = metrics.get(key, 0.0) + weight * value
        yield loss


def splits(cfg: RunConfig, backend_kind: str) -> bool:
    """Whether the learner may split a batch into micro-batches: the plain torch backend
    and group-relative advantages (GAE whitens over the whole batch's critic values)."""
    return backend_kind == "torch" and cfg.algo.advantages.estimator != "gae"


def update_loss(cfg: RunConfig, policy: PolicyLogprobs, kept: pa.Table, pad_id: int,
                beta: float, critic=None, backend_kind: str = "torch",
                ) -> tuple[torch.Tensor | Iterator[torch.Tensor], dict[str, torch.Tensor]]:
    """What one learner update backpropagates on the kept rows: the whole batch's loss, or
    its micro-batches' losses (`learner.micro_batch`, `learner.micro_batch_tokens`) as an
    iterator for the backend's gradient accumulation; and the batch's metrics (filled as
    the iterator is consumed)."""
    lc = cfg.learner
    if splits(cfg, backend_kind) and (lc.micro_batch or lc.micro_batch_tokens):
        order, parts = plan_micro_batches(row_lengths(kept), lc.micro_batch,
                                          lc.micro_batch_tokens)
        if len(parts) > 1:
            if lc.micro_batch_tokens is not None:
                kept = kept.take(pa.array(order))
            metrics: dict = {}
            return micro_losses(cfg, policy, kept, pad_id, beta, parts, metrics), metrics
    loss, metrics, _ = compute_loss(cfg, policy, kept, pad_id, beta, critic)
    return loss, metrics


def compute_loss(cfg: RunConfig, policy: PolicyLogprobs, table: pa.Table, pad_id: int,
                 beta: float, critic=None, share: Share | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], SeqBatch]:
    """Total loss (scalar) and detached metrics for the kept rows in `table`.

    `policy` gives the response-token logprobs (`PolicyModule` of the learner backend).
    The learner makes one optimizer step per batch, so this forward runs at the pre-update
    weights: its detached logprobs are the learner-old logprobs, compared with the behaviour
    logprobs in the mismatch metrics. With `algo.is_correction.enabled` the surrogate's ratio
    is taken against the learner-old logprobs (decoupled proximal policy) and every token's
    loss is weighted by `is_weight` (truncated, or IcePop's mask).

    With a `share` the table is one micro-batch of a larger batch (`micro_losses`): the
    aggregation and token means use the whole batch's weights, so the micro-batches' losses
    add up to the whole batch's.
    """
    algo = cfg.algo
    batch = build_batch(table, pad_id)
    mask = batch.response_mask  # (B, T)
    groups = group_index(table)  # (B,)
    ref = None
    if algo.kl.placement != "none" and table.column("ref_logprobs").null_count == 0:
        ref = batch.pad_response(padded_column(table, "ref_logprobs"))  # (B, T)
    elif algo.kl.placement != "none" and cfg.learner_reference:  # the base under the adapters
        ref = policy.reference(batch.input_ids, batch.attention_mask, batch.response_start,
                               temperature=cfg.rollout.temperature,
                               fp32_lm_head=cfg.model.fp32_lm_head,
                               logits_mb=cfg.learner.logits_chunk_mb)
    out = policy(batch.input_ids, batch.attention_mask, batch.response_start,
                 temperature=cfg.rollout.temperature, fp32_lm_head=cfg.model.fp32_lm_head,
                 logits_mb=cfg.learner.logits_chunk_mb)
    if share is not None:  # the whole batch's weights, at this micro-batch's width
        agg_w, token_w = share.agg[:, :batch.width], share.tokens[:, :batch.width]

    def reduce(per_token: torch.Tensor) -> torch.Tensor:
        if share is None:
            return aggregate(per_token, mask, algo.aggregation, groups)
        return (per_token * agg_w).sum()

    logprobs = out.logprobs  # (B, T)
    old = batch.pad_response(padded_column(table, "behavior_logprobs"))  # (B, T)
    learner_old = logprobs.detach()  # (B, T)
    metrics: dict[str, torch.Tensor] = logprob_mismatch(old, learner_old, mask)
    correction = algo.is_correction
    values = None
    if algo.advantages.estimator == "gae":
        values = critic.response_values(batch.input_ids, batch.attention_mask,
                                        batch.response_start)[:, : batch.width]  # (B, T)
        adv, returns = get_advantage_estimator("gae")(
            gae_rewards(cfg, table, batch, old, beta), mask, values=values.detach(),
            gamma=algo.advantages.gamma, lam=algo.advantages.lam)
        if algo.advantages.whiten:
            adv = masked_whiten(adv, mask)
    elif share is not None:
        adv = share.adv  # (B,), normalized over the whole batch
    else:
        adv = torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32))  # (B,)
        if algo.advantages.norm == "batch":  # over the batch being trained (prepare centers)
            adv = batch_normalize(adv)
    ratio_base = learner_old if correction.enabled else old
    per_token, pl_metrics = policy_loss(algo.loss.kind, logprobs, ratio_base, adv, mask,
                                        **loss_params(cfg))
    if correction.enabled:
        weight = is_weight(cfg, learner_old, old)  # (B, T)
        per_token = per_token * weight
        metrics["is_masked_frac"] = masked_mean((weight == 0).float(), mask)
    loss = reduce(per_token)
    metrics.update({k: v.detach() for k, v in pl_metrics.items()})
    metrics["policy_loss"] = loss.detach()
    if ref is not None:
        kl_tok = kl_penalty(logprobs, ref, algo.kl.estimator) * mask  # (B, T)
        stats = kl_stats(kl_tok.detach(), mask)
        metrics["kl_sum"], metrics["kl_mean"] = stats.kl_sum.mean(), stats.kl_mean.mean()
        if algo.kl.placement == "loss":
            # sampled by the behaviour policy: weighted by pi_learner / pi_behaviour (detached),
            # the term's expected gradient is the trained policy's (`algo.kl.estimator`)
            kl_w = weight if correction.enabled else truncated_is_weight(
                learner_old, old, algo.kl.importance_cap)
            loss = loss + beta * reduce(kl_tok * kl_w)
    entropy = masked_mean(out.entropy, mask) if share is None else (out.entropy * token_w).sum()
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
