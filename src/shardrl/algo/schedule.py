"""Learning-rate multiplier: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

from shardrl.algo.registry import unknown_name

LR_SCHEDULES = ("constant", "cosine")


def known_lr_schedules() -> list[str]:
    """Kinds accepted by `lr_schedule`, sorted."""
    return list(LR_SCHEDULES)


def lr_schedule(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    kind: str = "constant",
    min_ratio: float = 0.0,
) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based) of a run of
    `total_steps` steps (the last is `total_steps - 1`).

    Linear warmup `(step + 1) / warmup_steps` over the first `warmup_steps` steps, so the
    first step already learns and the last of them is at 1; then 1 ("constant") or
    `min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2` ("cosine"), p going from 0 at the
    first step after the warmup to 1 at the run's last step, and held at `min_ratio` after.
    """
    if kind not in LR_SCHEDULES:
        raise unknown_name("lr schedule", kind, known_lr_schedules())
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    decay_steps = total_steps - 1 - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min((step - warmup_steps) / decay_steps, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
