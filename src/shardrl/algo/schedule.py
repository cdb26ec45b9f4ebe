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
    """Multiplier of the base learning rate at optimizer step `step` (0-based).

    Linear warmup `step / warmup_steps` from 0 to 1 over the first `warmup_steps`; then 1
    ("constant") or `min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2` ("cosine"), p the
    share of the post-warmup steps done, held at `min_ratio` from `total_steps` on.
    """
    if kind not in LR_SCHEDULES:
        raise unknown_name("lr schedule", kind, known_lr_schedules())
    if step < warmup_steps:
        return step / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
