"""The generation-engine interface shared by the rollout stage and every backend.

An engine holds one policy version, samples `n` responses per prompt and reports, for every
sampled token, its log-probability under the distribution it was actually drawn from
(the behaviour log-probabilities the learner's importance ratios are taken against).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch


def mixed_seed(*parts: int) -> int:
    """A 63-bit sampling seed made from `parts` by hashing them together: seeds of nearby
    parts share no draws, where `base + part` made batch b's request j+1 and batch b+1's
    request j draw the same numbers."""
    high, low = np.random.SeedSequence([int(p) for p in parts]).generate_state(2)
    return (int(high) << 32 | int(low)) >> 1


@dataclass
class Sample:
    """One sampled response.

    `token_ids` are the generated tokens only (the prompt excluded), ending with the eos
    token when `finish_reason` is "stop"; `logprobs[i]` is the behaviour log-probability of
    `token_ids[i]` (same length).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


class Engine(Protocol):
    """A policy that can swap weights in place and sample groups of responses."""

    version: int

    def load_weights(self, state_dict_or_dir: dict[str, torch.Tensor] | str | Path,
                     version: int) -> None:
        """Replace the weights in place (no process restart) and set `version`."""
        ...

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
    ) -> list[list[Sample]]:
        """Sample `n` responses for each prompt; result[i] holds prompt i's `n` samples.

        Behaviour log-probabilities are those of softmax(logits / temperature), restricted to
        the top-p nucleus and renormalised when `top_p < 1`, computed in float32.
        """
        ...
