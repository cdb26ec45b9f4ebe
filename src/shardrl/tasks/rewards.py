"""Composite reward: weighted verifiers + optional reward model + overlong penalty.

    reward_rm = sum_i w_i * verifier_i(response, answer) + w_rm * rm(prompt + response)
                + overlong(len(response tokens))

Per sample the score stage writes `reward_verifier` (the weighted verifier sum, None
without verifiers), `reward_model` (the raw reward-model score, None without one),
`reward_rm` (the combined raw reward above, what `prepare` normalises), `correct` (every
verifier reached `correct_threshold` without error) and `reward_error` (why verifiers
failed, None if none did). A failing verifier contributes 0.0 and is counted, never raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardrl.tasks.sandbox import SandboxLimits
from shardrl.tasks.verifiers import Verifier, get_verifier, run_verifier

if TYPE_CHECKING:
    import pyarrow as pa

    from shardrl.config import RunConfig
    from shardrl.tasks.source import TaskData

TASK_VERIFIER = "task"
"""Spec naming the task's own checker (the built-in task's, or exact match for datasets)."""


@dataclass(frozen=True)
class VerifierTerm:
    """One verifier of the composite reward."""

    spec: str  # registered name, "task", or "package.module:function"
    weight: float = 1.0
    sandboxed: bool = False


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong penalty: 0 up to `max_len - buffer_tokens`, then a linear ramp
    down to `-penalty` at `max_len` (and beyond)."""

    max_len: int
    buffer_tokens: int
    penalty: float = 1.0


@dataclass(frozen=True)
class RewardSpec:
    """Everything that turns a response into a raw reward."""

    verifiers: tuple[VerifierTerm, ...] = ()
    reward_model_weight: float | None = None  # None: no reward model
    overlong: OverlongPenalty | None = None
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    correct_threshold: float = 1.0


def overlong_penalty(length: int, cfg: OverlongPenalty) -> float:
    """Penalty (<= 0) for a response of `length` tokens.

    E.g. max_len 16, buffer 4, penalty 1: length 12 -> 0, 14 -> -(14 - 12) / 4 = -0.5,
    16 or more -> -1.
    """
    start = cfg.max_len - cfg.buffer_tokens
    if length <= start:
        return 0.0
    return -cfg.penalty * min(1.0, (length - start) / cfg.buffer_tokens)


def build_verifiers(spec: RewardSpec, task_verifier: Verifier | None = None) -> list[Verifier]:
    """The callables for `spec.verifiers`, in order (import errors surface here, once)."""
    fns = []
    for term in spec.verifiers:
        if term.spec == TASK_VERIFIER:
            if task_verifier is None:
                raise ValueError("verifier 'task' needs the task's checker: pass task_verifier")
            if term.sandboxed:
                raise ValueError(
                    "the task's own checker runs in process: set `sandboxed: false` "
                    "for verifier 'task', or name a dotted-path verifier instead"
                )
            fns.append(task_verifier)
        else:
            fns.append(get_verifier(term.spec, sandboxed=term.sandboxed, limits=spec.sandbox))
    return fns


def score_batch(
    spec: RewardSpec,
    verifiers: Sequence[Verifier],
    responses: Sequence[str],
    answers: Sequence[str],
    response_lengths: Sequence[int],
    rm_scores: Sequence[float] | None = None,
    episode_returns: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """One dict per sample with reward_verifier, reward_model, reward_rm, correct and
    reward_error. `verifiers` come from `build_verifiers(spec)`; `rm_scores` are raw
    reward-model scores, required exactly when `spec.reward_model_weight` is set. With
    `episode_returns` (multi-turn episodes) the `task` verifier's value is the episode's
    return: the environment is the task's checker."""
    if (rm_scores is None) != (spec.reward_model_weight is None):
        raise ValueError("rm_scores must be given exactly when reward_model_weight is set")
    rows = []
    for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
        total, errors, correct = 0.0, [], bool(verifiers)
        for term, fn in zip(spec.verifiers, verifiers, strict=True):
            if episode_returns is not None and term.spec == TASK_VERIFIER:
                reward, error = float(episode_returns[i]), None
            else:
                reward, error = run_verifier(fn, response, answer)
            total += term.weight * reward
            correct = correct and error is None and reward >= spec.correct_threshold
            if error is not None:
                errors.append(f"{term.spec}: {error}")
        rm = None if rm_scores is None else float(rm_scores[i])
        combined = total + (0.0 if rm is None else spec.reward_model_weight * rm)
        if spec.overlong is not None:
            combined += overlong_penalty(response_lengths[i], spec.overlong)
        rows.append(
            {
                "reward_verifier": total if verifiers else None,
                "reward_model": rm,
                "reward_rm": combined,
                "correct": correct,
                "reward_error": "; ".join(errors) if errors else None,
            }
        )
    return rows


def error_count(rows: Sequence[dict[str, Any]]) -> int:
    """Samples whose verifiers reported at least one error."""
    return sum(row["reward_error"] is not None for row in rows)


class CompositeReward:
    """A `RewardSpec` with its verifiers built and its reward model (if any) loaded."""

    def __init__(
        self,
        spec: RewardSpec,
        verifiers: Sequence[Verifier],
        rm_scorer: Callable[[list[str]], list[float]] | None = None,
    ) -> None:
        if (rm_scorer is None) != (spec.reward_model_weight is None):
            raise ValueError(
                "a reward model scorer is needed exactly when reward_model_weight is set"
            )
        self.spec, self.verifiers, self.rm_scorer = spec, list(verifiers), rm_scorer

    def score_table(self, table: pa.Table) -> dict[str, list[Any]]:
        """Columns for a rollout table (needs prompt_text, response_text, answer,
        response_token_ids): {column name: one value per row}."""
        import pyarrow.compute as pc

        prompts = table.column("prompt_text").to_pylist()
        responses = table.column("response_text").to_pylist()
        lengths = pc.list_value_length(table.column("response_token_ids")).to_pylist()
        rm_scores = None
        if self.rm_scorer is not None:
            rm_scores = self.rm_scorer([p + r for p, r in zip(prompts, responses, strict=True)])
        rows = score_batch(
            self.spec,
            self.verifiers,
            responses,
            table.column("answer").to_pylist(),
            lengths,
            rm_scores,
            _episode_returns(table),
        )
        names = ("reward_verifier", "reward_model", "reward_rm", "correct", "reward_error")
        return {name: [row[name] for row in rows] for name in names}


def _episode_returns(table: pa.Table) -> list[float] | None:
    """Each row's sum of `turn_rewards`, None for a single-turn table."""
    if "turn_rewards" not in table.column_names:
        return None
    return [float(sum(r)) for r in table.column("turn_rewards").to_pylist()]


def spec_from_config(cfg: RunConfig) -> RewardSpec:
    """Map the run config's `reward` section onto a `RewardSpec`."""
    reward = cfg.reward
    overlong = None
    if reward.overlong is not None:
        overlong = OverlongPenalty(
            max_len=cfg.rollout.max_new_tokens,
            buffer_tokens=reward.overlong.buffer_tokens,
            penalty=reward.overlong.penalty,
        )
    return RewardSpec(
        verifiers=tuple(VerifierTerm(v.name, v.weight, v.sandboxed) for v in reward.verifiers),
        reward_model_weight=None if reward.reward_model is None else reward.reward_model.weight,
        overlong=overlong,
        sandbox=SandboxLimits(
            cpu_seconds=reward.sandbox.cpu_seconds,
            memory_mb=reward.sandbox.memory_mb,
            wall_seconds=reward.sandbox.wall_seconds,
            output_bytes=reward.sandbox.output_bytes,
            open_files=reward.sandbox.open_files,
        ),
    )


def build_reward(cfg: RunConfig, task: TaskData) -> CompositeReward:
    """The score stage's reward: verifiers built, reward model (and its tokenizer) loaded."""
    spec = spec_from_config(cfg)
    rm_scorer = None
    if cfg.reward.reward_model is not None:
        from shardrl.models.heads import load_reward_model, score_texts
        from shardrl.models.io import load_tokenizer

        rm_cfg = cfg.reward.reward_model
        rm, tokenizer = load_reward_model(rm_cfg.path), load_tokenizer(rm_cfg.path)

        def rm_scorer(texts: list[str]) -> list[float]:
            return score_texts(rm, tokenizer, texts, batch_size=rm_cfg.batch_size)

    return CompositeReward(spec, build_verifiers(spec, task.verify), rm_scorer)
