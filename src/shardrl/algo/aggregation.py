"""Loss aggregation modes, registered by name: `token`, `sample`, `prompt`.

The surrogate and its aggregation are independent choices: a policy loss gives a per-token
loss (B, T) and one of these reduces it to the scalar that is minimised.
    fn(per_token_loss (B, T), mask (B, T), group_ids (B,) | None) -> scalar
Every mode returns 0 (not NaN) when the mask selects no token.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from shardrl.algo.registry import Registry
from shardrl.algo.utils import as_weights, group_index, group_sum

AggregationFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]

_AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation mode")


def register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
    """Decorator registering an aggregation mode under `name`."""
    return _AGGREGATIONS.register(name)


def get_aggregation(mode: str) -> AggregationFn:
    """The aggregation registered as `mode` (error listing the known modes otherwise)."""
    return _AGGREGATIONS.get(mode)


def known_aggregations() -> list[str]:
    """Names of the registered aggregation modes, sorted."""
    return _AGGREGATIONS.names()


def aggregate(
    per_token_loss: Tensor, mask: Tensor, mode: str, group_ids: Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar with the registered aggregation `mode`."""
    return get_aggregation(mode)(per_token_loss, mask, group_ids)


@register_aggregation("token")
def token_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """sum(L * m) / sum(m) over the whole batch: every response token weighs the same."""
    m = as_weights(mask, per_token_loss)
    return (per_token_loss * m).sum() / m.sum().clamp_min(1.0)


@register_aggregation("sample")
def sample_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Mean over samples with at least one response token of their token-mean loss."""
    m = as_weights(mask, per_token_loss)
    tokens = m.sum(-1)  # (B,)
    per_sample = (per_token_loss * m).sum(-1) / tokens.clamp_min(1.0)  # (B,), 0 if no token
    return per_sample.sum() / (tokens > 0).sum().clamp_min(1)


@register_aggregation("prompt")
def prompt_mean(per_token_loss: Tensor, mask: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """ScaleRL's prompt-level mean: per group, its tokens' loss sum over its token count;
    then the mean over the groups that have at least one response token.

    group_ids: (B,) int64, any values; samples sharing an id form one group.
    """
    if group_ids is None:
        raise ValueError("aggregation 'prompt' needs group_ids (B,)")
    m = as_weights(mask, per_token_loss)
    index, num_groups = group_index(group_ids)
    loss_sums = group_sum((per_token_loss * m).sum(-1), index, num_groups)  # (G,)
    token_counts = group_sum(m.sum(-1), index, num_groups)  # (G,)
    per_group = loss_sums / token_counts.clamp_min(1.0)  # (G,), 0 if no token
    return per_group.sum() / (token_counts > 0).sum().clamp_min(1)
