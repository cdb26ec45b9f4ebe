"""The generation-engine interface shared by the rollout stage and every backend.

An engine holds one policy version, samples `n` responses per prompt and reports, for every
sampled token, its log-probability under the distribution it was actually drawn from
(the behaviour log-probabilities the learner's importance ratios are taken against).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


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
