"""The whole run: one section per part of the design, plus the checks that span sections."""

from __future__ import annotations

import hashlib
import json

from pydantic import Field, model_validator

from ..graph import STAGES
from .algo import AlgoConfig
from .base import Section
from .data import RewardConfig, TaskConfig
from .infra import DoctorConfig, PipelineConfig, StoreConfig, TrackingConfig, placed_worker
from .model import ModelConfig
from .stages import (
    EvalConfig,
    LearnerConfig,
    PrepareConfig,
    PromoteConfig,
    RolloutConfig,
    ScoreConfig,
)


class CrossSectionErrors(ValueError):
    """Problems that span sections, each a message naming its settings in backticks; the
    loader lists each under the first setting it names."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        super().__init__("; ".join(messages))


class RunConfig(Section):
    """A complete, validated ShardRL run."""

    name: str = Field("shardrl", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    """Human name of the run (run ids are derived from it)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Global seed."""
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    score: ScoreConfig = ScoreConfig()
    prepare: PrepareConfig = PrepareConfig()
    algo: AlgoConfig = AlgoConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    promote: PromoteConfig = PromoteConfig()
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    doctor: DoctorConfig = DoctorConfig()

    @model_validator(mode="after")
    def _cross_section_checks(self) -> RunConfig:
        errors = []
        if self.algo.kl.placement != "none" and self.model.reference == "none":
            errors.append(
                "KL placement "
                f"'{self.algo.kl.placement}' needs a reference model: set `model.reference: "
                "initial` (or a model folder), or `algo.kl.placement: none`"
            )
        if self.eval.every > self.learner.total_steps:
            errors.append(
                f"`eval.every` ({self.eval.every}) exceeds `learner.total_steps` "
                f"({self.learner.total_steps}): lower eval.every so at least one "
                "intermediate evaluation happens"
            )
        source = self.model.source
        if source.kind == "tiny":  # prompt + response must fit the model's context
            for name, tokens in (("rollout.max_new_tokens", self.rollout.max_new_tokens),
                                 ("eval.max_new_tokens", self.eval.max_new_tokens)):
                if tokens is not None and tokens >= source.max_position_embeddings:
                    errors.append(
                        f"`{name}` ({tokens}) leaves no room for a prompt in the model's "
                        f"context (`model.source.max_position_embeddings` "
                        f"{source.max_position_embeddings}): lower it or raise the context")
        for spec in STAGES:  # every stage that builds a vLLM engine runs on a GPU
            if spec.image(self) == "vllm" and getattr(self.pipeline.resources, spec.name).gpus == 0:
                errors.append(
                    f"rollout engine 'vllm' needs a GPU in stage {spec.name}: set "
                    f"`pipeline.resources.{spec.name}.gpus: 1` or `rollout.engine: hf`"
                )
        backend, learn_gpus = self.learner.backend, self.pipeline.resources.learn.gpus
        if backend.kind == "deepspeed" and 0 < learn_gpus < backend.ranks:
            errors.append(
                f"`learner.backend.ranks` ({backend.ranks}) exceeds the learner's GPUs "
                f"({learn_gpus}): one rank per GPU, so set `pipeline.resources.learn.gpus: "
                f"{backend.ranks}` or fewer ranks"
            )
        for name in ("micro_batch", "micro_batch_tokens"):
            if getattr(self.learner, name) is None:
                continue
            if backend.kind == "deepspeed":
                errors.append(
                    f"`learner.{name}` accumulates gradients with the torch backend only: "
                    "remove it or set `learner.backend: {kind: torch}`"
                )
            if self.algo.advantages.estimator == "gae":
                errors.append(
                    f"`learner.{name}` does not support GAE advantages yet (their whitening "
                    f"spans the whole batch's critic values): remove `learner.{name}`"
                )
        if backend.kind == "deepspeed" and self.learner.lora is not None:
            errors.append(
                "`learner.lora` trains adapters with the torch backend only (DeepSpeed would "
                "partition the frozen base with its optimizer): remove `learner.lora` or set "
                "`learner.backend: {kind: torch}`"
            )
        if self.learner.lora is not None and self.learner.keep_checkpoints < 2:
            errors.append(
                "`learner.lora` needs `learner.keep_checkpoints` of at least 2: a resumed "
                "learner takes its adapters from the checkpoint of the committed version, "
                "which a crash between the next checkpoint and its commit must not remove"
            )
        if self.algo.critic is not None and self.algo.advantages.estimator != "gae":
            errors.append(
                "a critic is configured but advantages are group-relative: remove `algo.critic` "
                "or set `algo.advantages.estimator: gae`"
            )
        if self.task.prompt_format == "chat" and self.model.source.kind == "tiny":
            errors.append(
                "`task.prompt_format: chat` needs a tokenizer with a chat template, and the "
                "tiny model's character tokenizer has none: set `task.prompt_format: raw` or "
                "`model.source: {kind: pretrained, path: ...}` with a chat model"
            )
        if self.rollout.max_turns > 1 and self.task.environment is None:
            errors.append(
                f"`rollout.max_turns` is {self.rollout.max_turns} but there is no environment "
                "to answer the turns: set `task.environment` (e.g. calculator) or "
                "`rollout.max_turns: 1`")
        if self.reward.overlong is not None and self.task.environment is not None:
            errors.append(
                "`reward.overlong` measures a response against `rollout.max_new_tokens`, one "
                "turn's limit, but an episode's response holds every turn and the environment's "
                "replies: it would penalise using the environment. Remove `reward.overlong` or "
                "`task.environment`")
        if self.rollout.postprocess == "inline" and (reason := self.inline_blocker()):
            errors.append(f"`rollout.postprocess: inline` {reason}: set "
                          "`rollout.postprocess: stages` (or auto)")
        local = self.pipeline.local
        for setting in ("cores", "nice"):
            for key, value in getattr(local, setting).items():
                worker = placed_worker(key, setting)
                if value is not None and worker is not None and worker >= self.rollout.workers:
                    errors.append(
                        f"`pipeline.local.{setting}.{key}` names no worker: rollout.workers "
                        f"is {self.rollout.workers} (workers rollout.0 to "
                        f"rollout.{self.rollout.workers - 1})")
        if errors:
            raise CrossSectionErrors(errors)
        return self

    @property
    def eval_max_new_tokens(self) -> int:
        """Response limit at evaluation (defaults to the rollout's)."""
        return self.eval.max_new_tokens or self.rollout.max_new_tokens

    def config_hash(self) -> str:
        """Short stable hash of the resolved config (registry tags, run ids)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def learner_reference(self) -> bool:
        """Whether the learner computes the reference logprobs itself: with LoRA, KL in the
        loss and the initial policy as reference, the reference is the frozen base under the
        adapters (run with the adapters off), so the score stage loads no reference."""
        return (self.learner.lora is not None and self.algo.kl.placement == "loss"
                and self.model.reference == "initial")

    def inline_blocker(self) -> str | None:
        """Why scoring and prepare cannot run inside the rollout workers, or None."""
        if self.algo.kl.placement != "none" and not self.learner_reference:
            return "cannot compute reference logprobs (KL is on)"
        if self.reward.reward_model is not None:
            return "cannot run a reward model"
        npr = self.algo.filters.no_positive_resampling.enabled
        if self.rollout.workers > 1 and (self.algo.shaping.normalize or npr):
            return ("with several rollout workers cannot share the reward statistics or the "
                    "pass-rate history across them")
        return None

    @property
    def inline_postprocess(self) -> bool:
        """Whether each rollout worker scores and prepares its own shards (no score and
        prepare stages); see `rollout.postprocess`."""
        mode = self.rollout.postprocess
        if mode != "auto":
            return mode == "inline"
        sandboxed = any(v.sandboxed or v.name == "python_exec" for v in self.reward.verifiers)
        return self.inline_blocker() is None and not sandboxed
