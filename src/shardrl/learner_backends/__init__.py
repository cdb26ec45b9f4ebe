"""Learner backends: plain torch (default) and DeepSpeed ZeRO, behind one `Backend` interface.

Build one with `build_backend(learner_cfg, lm, critic=..., critic_lr=...)` after the policy
(and critic) weights are loaded; DeepSpeed is imported only when it is configured.
"""

from __future__ import annotations

from torch import nn

from ..config.stages import LearnerConfig
from ..models.heads import Critic
from .base import Backend, CriticModule, OptimSettings, PolicyModule

__all__ = ["Backend", "CriticModule", "OptimSettings", "PolicyModule", "build_backend"]


def build_backend(learner: LearnerConfig, lm: nn.Module, *, critic: Critic | None = None,
                  critic_lr: float | None = None) -> Backend:
    """The configured backend over `lm` (and `critic`, trained at `critic_lr`)."""
    settings = OptimSettings.from_config(learner, critic_lr)
    cfg = learner.backend
    if cfg.kind == "deepspeed":
        from .deepspeed_backend import DeepSpeedLearnerBackend

        return DeepSpeedLearnerBackend(lm, settings, cfg, critic=critic)
    from .torch_backend import TorchLearnerBackend

    return TorchLearnerBackend(lm, settings, critic=critic, share_prompts=learner.share_prompts)
