"""What the doctor reports: a symptom with its evidence, likely causes and ordered remedies.

The causes and remedies follow the PPO-for-RLHF troubleshooting checklist (symptoms A-E,
"symptom -> cause -> fix", remedies in the checklist's priority order) and ScaleRL's
monitoring alerts (advantage explosion, over-filtering, truncation). Config keys are
tailored to the run: a fixed KL coefficient is `algo.kl.controller.beta`, an adaptive one
is steered through `algo.kl.controller.target`, and a remedy that needs a part the run does
not have (a critic for GAE) says so instead of silently disappearing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import RunConfig

MAX_SHOWN = 12  # evidence points shown per metric


@dataclass(frozen=True)
class Evidence:
    """The points of one metric that support a finding."""

    metric: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    note: str
    """What the points show, with the threshold they crossed."""


@dataclass(frozen=True)
class Remedy:
    action: str
    keys: tuple[str, ...] = ()
    """Config keys this remedy changes (dotted paths, usable with `--set`)."""


@dataclass(frozen=True)
class Finding:
    code: str
    """'A'..'E' (the checklist's symptoms), 'advantage', 'filtering', 'truncation'."""
    symptom: str
    summary: str
    step: int
    """The last step of the evidence: when the symptom was seen."""
    evidence: tuple[Evidence, ...]
    causes: tuple[str, ...]
    remedies: tuple[Remedy, ...]
    """In priority order: try the first one first."""

    @property
    def config_keys(self) -> tuple[str, ...]:
        """Every key the remedies touch, in remedy order, without repeats."""
        return tuple(dict.fromkeys(k for r in self.remedies for k in r.keys))

    def to_dict(self) -> dict:
        return asdict(self) | {"config_keys": list(self.config_keys)}

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        """The finding `to_dict` wrote (extra keys ignored)."""
        return cls(d["code"], d["symptom"], d["summary"], int(d["step"]),
                   tuple(Evidence(e["metric"], tuple(e["steps"]), tuple(e["values"]), e["note"])
                         for e in d["evidence"]),
                   tuple(d["causes"]), tuple(Remedy(r["action"], tuple(r["keys"]))
                                             for r in d["remedies"]))


def evidence(metric: str, steps, values, note: str) -> Evidence:
    """Evidence from array-likes, keeping the last MAX_SHOWN points."""
    steps, values = list(steps)[-MAX_SHOWN:], list(values)[-MAX_SHOWN:]
    return Evidence(metric, tuple(int(s) for s in steps), tuple(float(v) for v in values), note)


def _kl_strength(cfg: RunConfig, stronger: bool) -> Remedy:
    """'Raise beta / lower target_kl' (stronger) or the reverse, with this run's keys."""
    ctl = cfg.algo.kl.controller
    if cfg.algo.kl.placement == "none":
        beta = "algo.kl.controller." + ("beta" if ctl.kind == "fixed" else "init_beta")
        return Remedy("KL to the reference is off: turn it on" if stronger else
                      "KL to the reference is off: nothing to relax",
                      ("algo.kl.placement", beta) if stronger else ())
    if ctl.kind == "fixed":
        return Remedy(f"{'raise' if stronger else 'lower'} the KL coefficient beta "
                      f"(now {ctl.beta:g})", ("algo.kl.controller.beta",))
    return Remedy(f"{'lower' if stronger else 'raise'} the KL target (now {ctl.target:g}) "
                  f"of the {ctl.kind} controller", ("algo.kl.controller.target",))


def _clip_range(cfg: RunConfig) -> Remedy:
    loss = cfg.algo.loss
    if loss.kind in ("dppo_tv", "dppo_kl"):
        return Remedy(f"widen the trust region moderately (delta now {loss.delta_low:g}/"
                      f"{loss.delta_high:g}) and watch clip_frac leave ~0",
                      ("algo.loss.delta_low", "algo.loss.delta_high"))
    if loss.kind == "cispo":
        return Remedy(f"loosen the importance-weight cap (max_ratio now {loss.max_ratio:g}) and "
                      "watch clip_frac leave ~0 for a moderate range", ("algo.loss.max_ratio",))
    # GSPO clips a length-normalised sequence ratio, whose range is some thousand times
    # narrower than a token ratio's (3e-4/4e-4 by default): a token-level example misleads
    example = "e.g. 1.5x" if loss.kind == "gspo" else "e.g. 0.1 -> 0.2"
    return Remedy(f"widen the clip range moderately (eps now {loss.eps_low:g}/{loss.eps_high:g}, "
                  f"{example}) and watch clip_frac leave ~0 for a moderate range",
                  ("algo.loss.eps_low", "algo.loss.eps_high"))


def playbook(code: str, cfg: RunConfig) -> tuple[str, tuple[str, ...], tuple[Remedy, ...]]:
    """(symptom name, likely causes, remedies in priority order) of symptom `code`."""
    norm_clip = Remedy("turn on / strengthen reward normalisation and clipping (clip before "
                       "normalising is worth a try)",
                       ("algo.shaping.normalize", "algo.shaping.clip",
                        "algo.shaping.clip_before_norm"))
    if code == "A":
        return "KL blow-up", (
            "learning rate too large (especially the policy's)",
            "beta too small or KL target too high: the constraint is too weak",
            "reward scale too large or not normalised: advantages explode",
            "responses suddenly longer: kl_sum grows with length",
        ), (
            Remedy("halve the policy learning rate first and check that KL slows at once",
                   ("learner.lr",)),
            _kl_strength(cfg, stronger=True),
            norm_clip,
            Remedy("cap the response length or penalise overlong responses, so lengthening "
                   "cannot buy reward", ("rollout.max_new_tokens", "reward.overlong")),
        )
    if code == "B":
        return "KL stuck near zero, reward flat", (
            "beta too large: the penalty dominates",
            "reward scaled too small: the learning signal is weak",
            "clipping too conservative: updates are cut off",
        ), (
            _kl_strength(cfg, stronger=False),
            Remedy("raise the reward weight alpha, or check that reward normalisation does not "
                   "squeeze its variance too low",
                   ("algo.shaping.alpha", "algo.shaping.normalize")),
            _clip_range(cfg),
        )
    if code == "C":
        # the value-head and GAE causes and remedies only where the run has a critic
        critic = cfg.algo.critic is not None
        return "value loss / advantage / gradient spikes", (
            "reward distribution too peaked or with many outliers",
            *(("value-head learning rate too large",
               "GAE parameters unsuitable (a large lambda raises variance)") if critic else ()),
            "grad_norm spikes alone: numerical overflow or an abnormal batch (see inf/nan logs)",
        ), (
            Remedy("clip and normalise the reward to suppress outliers first",
                   ("algo.shaping.clip", "algo.shaping.normalize")),
            *((Remedy("lower the value-head learning rate or the value loss's weight",
                      ("algo.critic.lr", "algo.critic.vf_coef")),
               Remedy("lower GAE lambda (e.g. 0.95 -> 0.9) or gamma to cut long-range variance",
                      ("algo.advantages.lam", "algo.advantages.gamma"))) if critic else ()),
            Remedy("lower the policy's learning rate or clip the gradient tighter",
                   ("learner.lr", "learner.grad_clip")),
        )
    if code == "D":
        return "reward hacking", (
            "the reward model is biased and the policy exploits it",
            "the prompt distribution is narrow: the policy found a shortcut",
            "the KL constraint is too weak: the policy leaves the language-quality baseline",
        ), (
            _kl_strength(cfg, stronger=True),
            Remedy("add a length penalty or a length-normalised reward so padding cannot score",
                   ("reward.overlong", "rollout.max_new_tokens")),
            Remedy("audit samples by hand (`shardrl samples RUN --best`) and add the hacking "
                   "patterns as reward-model negatives or improve its training",
                   ("reward.reward_model.path",)),
        )
    if code == "E":
        return "mid-run collapse", (
            "the data distribution switched (prompts of another domain mixed in)",
            "reference or tokenizer settings differ from the policy's: KL is computed wrongly",
            "mixed-precision overflow or wrong gradient accumulation",
        ), (
            Remedy("fix the seed and reproduce; compare the prompts of the batches before and "
                   "after the step (`shardrl samples RUN --version N`)", ("seed", "task.source")),
            Remedy("check that policy and reference share tokenizer, padding and eos/bos, and "
                   "that the reference is frozen", ("model.reference",)),
            Remedy("look for inf/nan in loss and gradients; keep gradient clipping on (e.g. 1.0) "
                   "and check the precision settings", ("learner.grad_clip", "model.dtype")),
        )
    if code == "advantage":
        return "advantage explosion", (
            "reward scale too large or not normalised",
            "advantages not normalised",
        ), (
            Remedy("normalise the reward with running mean/std", ("algo.shaping.normalize",)),
            Remedy("clip the reward (e.g. +-5 or +-10)", ("algo.shaping.clip",)),
            Remedy("whiten the advantages over the batch", ("algo.advantages.whiten",))
            if cfg.algo.advantages.estimator == "gae" else
            Remedy("normalise advantages per batch or per prompt", ("algo.advantages.norm",)),
        )
    if code == "filtering":
        return "over-filtering", (
            "most groups are all-correct or all-wrong: prompts too easy or too hard for the policy",
            "groups too small to show mixed outcomes",
        ), (
            Remedy("retire solved prompts (No-Positive-Resampling)",
                   ("algo.filters.no_positive_resampling.enabled",)),
            Remedy("draw more samples per prompt", ("rollout.group_size",)),
            Remedy("use prompts matched to the policy's level", ("task.source",)),
        )
    if code == "truncation":
        return "truncation", (
            "the token limit is too small for the answers the task needs",
            "the policy lengthens responses to gain reward, or stops emitting eos",
            "multi-turn episodes run out of turns before the environment ends them",
        ), (
            Remedy("audit truncated samples (`shardrl samples RUN --worst`); raise the limit if "
                   "answers legitimately need it", ("rollout.max_new_tokens",)),
            Remedy("penalise overlong responses", ("reward.overlong",)),
            Remedy("check the eos/stop settings of the tokenizer and the engine",
                   ("model.source",)),
            Remedy("give episodes the turns the task needs (the samples' `turns` column)",
                   ("rollout.max_turns",)),
        )
    if code == "drift":
        return "policy drift between sampler and learner", (
            "each update moves the policy far (a learning rate too high): samples even one "
            "version old no longer fit it",
            "samples many versions old (a large staleness bound)",
            "the sampler's numerics differ from the learner's (weights published in bfloat16, "
            "another engine)",
        ), (
            Remedy("lower the learning rate first and watch the drift fall at once",
                   ("learner.lr",)),
            Remedy("lower the staleness bound", ("learner.max_staleness",)),
            Remedy("correct for the mismatch with truncated importance weights",
                   ("algo.is_correction.enabled",)),
            Remedy("publish the weights in float32", ("learner.publish.dtype",)),
        )
    raise KeyError(f"unknown symptom code {code!r}")


def make_finding(code: str, summary: str, ev: list[Evidence], cfg: RunConfig,
                 step: int | None = None) -> Finding:
    """The finding with the playbook's causes and remedies; `step` defaults to the last
    step of the evidence."""
    symptom, causes, remedies = playbook(code, cfg)
    if step is None:
        step = max((e.steps[-1] for e in ev if e.steps), default=0)
    return Finding(code, symptom, summary, step, tuple(ev), causes, remedies)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def format_finding(f: Finding) -> str:
    """A finding as indented text for terminals and logs."""
    lines = [f"[{f.code}] {f.symptom} (step {f.step}): {f.summary}", "  evidence:"]
    for e in f.evidence:
        shown = ", ".join(f"{s}:{_fmt(v)}" for s, v in zip(e.steps, e.values, strict=True))
        lines.append(f"    {e.metric}: {e.note}" + (f"  [{shown}]" if shown else ""))
    lines.append("  likely causes:")
    lines += [f"    {i}. {c}" for i, c in enumerate(f.causes, 1)]
    lines.append("  remedies, in this order:")
    for i, r in enumerate(f.remedies, 1):
        lines.append(f"    {i}. {r.action}" + (f"  -> {', '.join(r.keys)}" if r.keys else ""))
    return "\n".join(lines)


def finding_tags(findings: list[Finding]) -> dict[str, str]:
    """MLflow tags for a run's findings: `doctor.findings` and one `doctor.<code>` each."""
    tags = {"doctor.findings": ",".join(f.code for f in findings) or "none"}
    tags.update({f"doctor.{f.code}": f"{f.symptom} at step {f.step}: {f.summary}"[:5000]
                 for f in findings})
    return tags
