"""The math of ShardRL's recipes as pure torch functions, registered by name.

Policy losses (`cispo`, `ppo`, `gspo`, `dppo_tv`, `dppo_kl`) and aggregations (`token`, `sample`, `prompt`) are
independent choices; advantages (`group`, `gae`), KL estimators (`k1`, `k2`, `k3`) and
controllers, reward shaping, value loss, data filters and the LR schedule complete the
ScaleRL and PPO-RLHF recipes. Callers resolve configured names through the registries.
"""

from shardrl.algo.advantages import (
    ADVANTAGE_NORMS,
    batch_normalize,
    gae,
    get_advantage_estimator,
    group_advantages,
    known_advantage_estimators,
    known_advantage_norms,
    register_advantage_estimator,
    shard_norm,
)
from shardrl.algo.aggregation import (
    aggregate,
    get_aggregation,
    known_aggregations,
    register_aggregation,
)
from shardrl.algo.filters import PassRateTracker, zero_variance_keep
from shardrl.algo.kl import (
    KLStats,
    get_kl_estimator,
    kl_penalty,
    kl_stats,
    known_kl_estimators,
    register_kl_estimator,
)
from shardrl.algo.kl_control import (
    AdaptiveKLController,
    ExpKLController,
    FixedKLController,
    KLController,
    get_kl_controller,
    known_kl_controllers,
)
from shardrl.algo.policy_losses import (
    get_policy_loss,
    known_policy_losses,
    policy_loss,
    register_policy_loss,
)
from shardrl.algo.registry import UnknownNameError
from shardrl.algo.schedule import LR_SCHEDULES, known_lr_schedules, lr_schedule
from shardrl.algo.shaping import RunningMoments, normalized_scores, shape_rewards
from shardrl.algo.utils import (
    LOG_RATIO_CLAMP,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from shardrl.algo.value import value_loss

__all__ = [
    "ADVANTAGE_NORMS",
    "LOG_RATIO_CLAMP",
    "LR_SCHEDULES",
    "AdaptiveKLController",
    "ExpKLController",
    "FixedKLController",
    "KLController",
    "KLStats",
    "PassRateTracker",
    "RunningMoments",
    "UnknownNameError",
    "aggregate",
    "entropy_from_logits",
    "gae",
    "get_advantage_estimator",
    "get_aggregation",
    "get_kl_controller",
    "get_kl_estimator",
    "get_policy_loss",
    "group_advantages",
    "batch_normalize",
    "shard_norm",
    "kl_penalty",
    "kl_stats",
    "known_advantage_estimators",
    "known_advantage_norms",
    "known_aggregations",
    "known_kl_controllers",
    "known_kl_estimators",
    "known_lr_schedules",
    "known_policy_losses",
    "lr_schedule",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalized_scores",
    "policy_loss",
    "register_advantage_estimator",
    "register_aggregation",
    "register_kl_estimator",
    "register_policy_loss",
    "shape_rewards",
    "value_loss",
    "zero_variance_keep",
]
