"""Algorithm settings: surrogate loss, aggregation, advantages, KL, shaping, filters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Section


class CISPOLoss(Section):
    """CISPO: REINFORCE with a stop-gradient, truncated importance weight (MiniMax-M1, ScaleRL)."""

    kind: Literal["cispo"] = "cispo"
    max_ratio: float = Field(4.0, gt=1.0, le=1000.0)
    """Upper cap on the CISPO importance weight."""
    min_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Optional lower cap on the importance weight."""


class PPOLoss(Section):
    """PPO clipped surrogate with asymmetric clipping and optional dual clip."""

    kind: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip: ratio >= 1 - eps_low."""
    eps_high: float = Field(0.2, gt=0.0, le=10.0)
    """Upper clip: ratio <= 1 + eps_high."""
    dual_clip: float | None = Field(None, gt=1.0, le=100.0)
    """Dual-clip constant c for negative advantages."""


class GSPOLoss(Section):
    """GSPO: PPO clipping on the sequence-level (length-normalised) ratio."""

    kind: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """Lower clip on the sequence ratio."""
    eps_high: float = Field(4e-4, gt=0.0, le=10.0)
    """Upper clip on the sequence ratio."""


class DPPOTVLoss(Section):
    """DPPO, binary total-variation trust region (arXiv 2602.04879): CISPO's update on the
    tokens whose probability has not moved more than delta in the advantage's direction."""

    kind: Literal["dppo_tv"] = "dppo_tv"
    delta_low: float = Field(0.15, gt=0.0, le=1.0)
    """Largest fall of a token's probability (advantage < 0) that still gets a gradient."""
    delta_high: float = Field(0.15, gt=0.0, le=1.0)
    """Largest rise of a token's probability (advantage > 0) that still gets a gradient."""
    max_ratio: float = Field(20.0, gt=1.0, le=1e6)
    """Upper cap on the stop-gradient importance weight."""


class DPPOKLLoss(Section):
    """DPPO, binary KL trust region (arXiv 2602.04879): as dppo_tv with
    KL(Bernoulli(old prob) || Bernoulli(new prob)) of the sampled token."""

    kind: Literal["dppo_kl"] = "dppo_kl"
    delta_low: float = Field(0.05, gt=0.0, le=100.0)
    """Largest binary KL of a falling token (advantage < 0) that still gets a gradient."""
    delta_high: float = Field(0.05, gt=0.0, le=100.0)
    """Largest binary KL of a rising token (advantage > 0) that still gets a gradient."""
    max_ratio: float = Field(20.0, gt=1.0, le=1e6)
    """Upper cap on the stop-gradient importance weight."""


PolicyLoss = Annotated[CISPOLoss | PPOLoss | GSPOLoss | DPPOTVLoss | DPPOKLLoss,
                       Field(discriminator="kind")]


class GroupAdvantages(Section):
    """Group-relative advantages r - mean(group)."""

    estimator: Literal["group"] = "group"
    norm: Literal["none", "batch", "prompt"] = "batch"
    """Divide by nothing, by the std over the learner's batch (its rows kept by filtering;
    ScaleRL's batch-level normalization), or by the group's std."""


class GAEAdvantages(Section):
    """Generalised advantage estimation with a learned critic."""

    estimator: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    whiten: bool = True
    """Whiten advantages over the batch's response tokens."""


Advantages = Annotated[GroupAdvantages | GAEAdvantages, Field(discriminator="estimator")]


class FixedKL(Section):
    """Constant KL coefficient."""

    kind: Literal["fixed"] = "fixed"
    beta: float = Field(0.01, ge=0.0, le=100.0)
    """KL coefficient."""


class AdaptiveKL(Section):
    """Ziegler et al. 2019 proportional controller."""

    kind: Literal["adaptive"] = "adaptive"
    init_beta: float = Field(0.05, gt=0.0, le=100.0)
    """Starting coefficient."""
    target: float = Field(6.0, gt=0.0, le=1000.0)
    """Target sequence KL (kl_sum)."""
    horizon: int = Field(10000, ge=1, le=10_000_000)
    """Samples over which the error is corrected."""


class ExpKL(Section):
    """Exponential controller: beta *= exp((kl - target) / target * rate)."""

    kind: Literal["exp"] = "exp"
    init_beta: float = Field(0.05, gt=0.0, le=100.0)
    """Starting coefficient."""
    target: float = Field(6.0, gt=0.0, le=1000.0)
    """Target sequence KL (kl_sum)."""
    rate: float = Field(0.1, gt=0.0, le=10.0)
    """Adaptation rate."""


KLController = Annotated[FixedKL | AdaptiveKL | ExpKL, Field(discriminator="kind")]


class KLConfig(Section):
    """KL regularisation towards the frozen reference."""

    placement: Literal["none", "reward", "loss"] = "none"
    """'reward': r - beta*KL per sequence; 'loss': a KL term added to the loss; 'none': off."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(policy || reference) on the sampled tokens (k1 and k3
    unbiased, k2 biased). In the loss only its gradient acts, and there k2's expected gradient
    is KL(policy || reference)'s, k3's is the forward KL(reference || policy)'s (which covers
    the reference's mass: GRPO's choice) and k1's is 0 (refused)."""
    controller: KLController = FixedKL()
    """How beta is chosen."""
    importance_cap: float = Field(2.0, gt=1.0, le=1000.0)
    """In the loss: the samples come from the behaviour policy (a version or more behind,
    and another engine), so each token's KL term is weighted by min(pi_learner /
    pi_behaviour, cap), detached, to give the expected gradient named above for the policy
    being trained. With `algo.is_correction.enabled` that correction's weight is used
    instead, as for the policy loss."""


class RewardShaping(Section):
    """reward_total = alpha * clip(normalize(reward_rm)) - beta * kl (KL never normalised).
    With GAE the KL is not in reward_total: the learner adds -beta * kl on every response
    token and the shaped score on the last one."""

    normalize: bool = False
    """Running mean/std normalisation of the raw reward."""
    clip: float | None = Field(None, gt=0.0, le=1e6)
    """Clip the (normalised) reward to +-clip."""
    clip_before_norm: bool = False
    """Clip first, then normalise (by the running statistics of the clipped scores)."""
    alpha: float = Field(1.0, gt=0.0, le=1e6)
    """Weight of the reward term."""


class NoPositiveResampling(Section):
    """Retire prompts that are already solved from later epochs (ScaleRL)."""

    enabled: bool = False
    retire_at: float = Field(0.9, gt=0.0, le=1.0)
    """Pass rate at which a prompt is retired."""
    window: int = Field(100, ge=1, le=1_000_000)
    """Samples of a prompt considered."""
    min_samples: int = Field(8, ge=1, le=1_000_000)
    """Samples needed before a prompt can retire."""


class Filters(Section):
    """Which samples leave the loss."""

    zero_variance: bool = True
    """Drop groups whose scores (`reward_rm`, the verifier's or reward model's, before
    shaping) are all equal: no learning signal from the task. The score, not the total alone:
    with `kl.placement: reward` a group's KL terms almost never tie, so the total would filter
    nothing; a dropped group's KL term then leaves the loss with it. With group advantages a
    group whose shaped totals are all equal (a clip can make different scores equal) is
    dropped too: its advantages are all 0."""
    zero_variance_tol: float = Field(1e-6, ge=0.0, le=1.0)
    """Population-std tolerance for 'all equal'."""
    no_positive_resampling: NoPositiveResampling = NoPositiveResampling()
    """Retire solved prompts."""


class CriticConfig(Section):
    """Value model for GAE: the reference backbone with a scalar head."""

    lr: float = Field(1e-4, gt=0.0, le=1.0)
    """Critic learning rate, constant: the policy's schedule (`learner.warmup_steps`,
    `learner.schedule`) does not apply, so the value head learns from the first step."""
    vf_coef: float = Field(0.5, gt=0.0, le=100.0)
    """Weight of the value loss."""
    clip_range: float | None = Field(None, gt=0.0, le=1e6)
    """PPO's value clipping, which the learner does not do (set it and the config is refused):
    it bounds how far the values move from the old ones over several updates of one batch,
    and each batch here is trained in one update, whose values are the old ones."""


class ISCorrection(Section):
    """Importance weights between behaviour (generator) and learner logprobs of the same
    tokens, k = pi_learner_old / pi_behaviour: the engines' mismatch (and policy lag). The
    loss's ratio is then taken against pi_learner_old, which one update per batch makes 1:
    the clip or trust region of ppo, gspo and dppo_* does not act, and the truncation or
    mask of k is the only bound on a token's update."""

    enabled: bool = False
    mode: Literal["truncate", "mask"] = "truncate"
    """truncate: token weight min(k, cap). mask (IcePop, Ring-1T, arXiv 2510.18855): weight k where
    low <= k <= cap and 0 elsewhere, so tokens the engines disagree on too much give no
    gradient at all."""
    cap: float = Field(2.0, gt=1.0, le=1000.0)
    """Upper bound on k (truncation point, or mask edge)."""
    low: float = Field(0.5, gt=0.0, lt=1.0)
    """Lower mask edge (mode mask)."""


class AlgoConfig(Section):
    """The learning rule. Surrogate and aggregation are independent choices."""

    loss: PolicyLoss = CISPOLoss()
    """Policy surrogate."""
    aggregation: Literal["token", "sample", "prompt"] = "prompt"
    """How per-token losses become one scalar."""
    advantages: Advantages = GroupAdvantages()
    """Advantage estimator."""
    kl: KLConfig = KLConfig()
    """KL to the reference."""
    shaping: RewardShaping = RewardShaping()
    """Reward normalisation and clipping."""
    filters: Filters = Filters()
    """Zero-variance filtering and No-Positive-Resampling."""
    critic: CriticConfig | None = None
    """Value model (required by GAE)."""
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0)
    """Entropy bonus weight."""
    is_correction: ISCorrection = ISCorrection()
    """Behaviour/learner logprob mismatch correction."""

    @model_validator(mode="after")
    def _cross_checks(self) -> AlgoConfig:
        if self.advantages.estimator == "gae" and self.critic is None:
            raise ValueError(
                "estimator 'gae' needs a critic: set `algo.critic: {}` "
                "or choose `algo.advantages.estimator: group`"
            )
        if self.critic is not None and self.critic.clip_range is not None:
            raise ValueError(
                "`algo.critic.clip_range` would do nothing: the learner trains each batch in one "
                "update, whose values are the old values, so the clip never binds; remove it")
        if self.kl.placement == "loss" and self.kl.estimator == "k1":
            raise ValueError(
                "`algo.kl.estimator: k1` in the loss has zero expected gradient (the mean of "
                "grad log p under the policy is 0), so it would not pull towards the reference: "
                "use k2 (its gradient is that of KL(policy || reference)) or k3 (that of "
                "KL(reference || policy)) in the loss, or k1 with `algo.kl.placement: reward`")
        loss = self.loss
        if isinstance(loss, CISPOLoss) and loss.min_ratio is not None:
            if loss.min_ratio >= loss.max_ratio:
                raise ValueError("`algo.loss.min_ratio` must be below `algo.loss.max_ratio`")
        return self
