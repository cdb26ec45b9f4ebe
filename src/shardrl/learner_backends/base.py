"""The learner-backend interface: forward modules, one optimizer step, checkpoint state.

A backend owns the trainable modules (the policy, and the critic when GAE is on) and their
AdamW optimizer. The learner computes its loss through `backend.policy` and
`backend.critic`, hands the scalar to `backend.step`, and checkpoints `backend.state_dict()`
(plain tensors, saved as safetensors: no pickle). Both backends write the same state: the
full, unpartitioned AdamW moments of every named parameter, so a checkpoint written by one
backend, or by any number of DeepSpeed ranks, resumes under the other.

Model weights are not part of that state: the learner publishes them as policy versions and
loads them into the modules *before* building the backend.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from ..config.stages import LearnerConfig
from ..models.heads import Critic, TokenLogprobs, logits_chunk, token_logprobs

POLICY, CRITIC = "policy", "critic"
"""Names of the trainable parts, in the order of the optimizer's parameter groups."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW state slots saved per parameter."""
MASTER = "fp32"
"""State slot of a parameter's float32 master where the module trains in a narrower dtype
(DeepSpeed's bf16): `policy/<name>/fp32`."""
STEP_KEY = "step"
"""State key of the optimizer's step count (a float32 scalar)."""

Json = dict[str, "Json"] | list["Json"] | str | int | float | bool | None


class PolicyLogprobs(Protocol):
    """What the loss needs from the policy: response-token logprobs (see `token_logprobs`)."""

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_start: Tensor, *,
                 temperature: float, fp32_lm_head: bool,
                 logits_mb: float | None = None) -> TokenLogprobs: ...

    def reference(self, input_ids: Tensor, attention_mask: Tensor, response_start: Tensor, *,
                  temperature: float, fp32_lm_head: bool,
                  logits_mb: float | None = None) -> Tensor | None:
        """The frozen base's logprobs under LoRA adapters, or None (see `PolicyModule`)."""
        ...


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class PolicyModule(nn.Module):
    """A causal LM whose forward is `token_logprobs`.

    The output head is used inside this module's forward, so DeepSpeed ZeRO-3 (which gathers
    a partitioned parameter only within the forward of a module that owns it, or registers it)
    has the head weight when the FP32 head reads it directly. Inputs move to the model's
    device and outputs come back to the inputs' device, so the loss arithmetic stays where
    the batch lives.
    """

    def __init__(self, lm: nn.Module, share_prompts: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.share_prompts = share_prompts
        """Compute each distinct prompt once per forward (`token_logprobs`)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_start: Tensor, *,
                temperature: float = 1.0, fp32_lm_head: bool = True,
                logits_mb: float | None = None) -> TokenLogprobs:
        """input_ids, attention_mask: (B, L); response_start: (B,). Outputs (B, T).

        `logits_mb`: the most MiB of float32 logits computed at once (see `token_logprobs`'s
        `chunk`); None computes them whole."""
        home, device = input_ids.device, _device_of(self.lm)
        chunk = logits_chunk(input_ids.shape[0], self.lm.config.vocab_size, logits_mb)
        out = token_logprobs(self.lm, input_ids.to(device), attention_mask.to(device),
                             response_start.to(device), temperature=temperature,
                             fp32_lm_head=fp32_lm_head, chunk=chunk,
                             share_prompts=self.share_prompts)
        return TokenLogprobs(out.logprobs.to(home), out.entropy.to(home), None)

    def reference(self, input_ids: Tensor, attention_mask: Tensor, response_start: Tensor, *,
                  temperature: float = 1.0, fp32_lm_head: bool = True,
                  logits_mb: float | None = None) -> Tensor | None:
        """(B, T) response-token logprobs of the frozen base under LoRA adapters (the
        adapters off, no gradient), or None when the policy has no adapters. Call it before
        the forward whose graph the step backpropagates (see `lora.adapters_off`)."""
        from ..models.lora import adapters_off, has_lora

        if not has_lora(self.lm):
            return None
        with torch.no_grad(), adapters_off(self.lm):
            return self(input_ids, attention_mask, response_start, temperature=temperature,
                        fp32_lm_head=fp32_lm_head, logits_mb=logits_mb).logprobs


class CriticModule(nn.Module):
    """A `Critic` whose `response_values` takes and returns tensors on the batch's device."""

    def __init__(self, critic: Critic) -> None:
        super().__init__()
        self.critic = critic

    def response_values(self, input_ids: Tensor, attention_mask: Tensor,
                        response_start: Tensor) -> Tensor:
        """(B, T) values, same alignment as `Critic.response_values`."""
        home, device = input_ids.device, _device_of(self.critic)
        values = self.critic.response_values(input_ids.to(device), attention_mask.to(device),
                                             response_start.to(device))
        return values.to(home)

    forward = response_values


@dataclass(frozen=True)
class OptimSettings:
    """AdamW settings shared by both backends; the critic differs only in its learning rate."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float | None
    critic_lr: float | None = None

    @classmethod
    def from_config(cls, learner: LearnerConfig, critic_lr: float | None = None) -> OptimSettings:
        return cls(lr=learner.lr, betas=(learner.beta1, learner.beta2),
                   weight_decay=learner.weight_decay, grad_clip=learner.grad_clip,
                   critic_lr=critic_lr)

    def param_groups(self, parts: dict[str, nn.Module]) -> list[dict]:
        """One AdamW parameter group per part, in `parts` order (policy first)."""
        lrs = {POLICY: self.lr, CRITIC: self.critic_lr}
        return [{"params": [p for p in module.parameters() if p.requires_grad],
                 "lr": lrs[name], "name": name} for name, module in parts.items()]


def moment_key(part: str, param_name: str, slot: str) -> str:
    """State key of one AdamW moment, e.g. `policy/model.norm.weight/exp_avg`."""
    return f"{part}/{param_name}/{slot}"


def trainable_parts(policy: nn.Module, critic: nn.Module | None) -> dict[str, nn.Module]:
    """{"policy": ..., "critic": ...} without the critic when there is none."""
    return {POLICY: policy} | ({CRITIC: critic} if critic is not None else {})


class Loan:
    """Live state tensors lent to a reader on another thread (a checkpoint writer): the
    backend that lent them changes none of them until the reader calls `done`."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def done(self) -> None:
        """The reader no longer reads the tensors (call it when it fails too)."""
        self._done.set()

    def wait(self) -> None:
        self._done.wait()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()


class Backend(Protocol):
    """A learner backend (torch or DeepSpeed)."""

    policy: PolicyModule
    critic: CriticModule | None
    rank: int
    world_size: int
    lends_state: bool
    """Whether `state_dict(copy=False)` gives the live tensors, for a reader that holds a
    `lend()` loan, instead of copies."""

    def set_lr(self, part: str, lr: float) -> None:
        """Learning rate of one part's parameter group (the schedule calls this every step)."""
        ...

    def step(self, loss: Tensor) -> tuple[bool, float]:
        """Backward, clip, AdamW step. (False, norm) and no update when the loss or the
        gradient norm is not finite; the same decision on every rank. The torch backend also
        takes an iterable of micro-batch losses (`learner.micro_batch`, `micro_batch_tokens`)."""
        ...

    def gathered(self) -> AbstractContextManager[None]:
        """Within it the modules hold their full weights (ZeRO-3 gathers them); for publishing."""
        ...

    def state_dict(self, copy: bool = True, everywhere: bool = True) -> dict[str, Tensor]:
        """Full AdamW state as CPU tensors (a collective call under DeepSpeed); with
        `copy=False` the optimizer's own tensors where `lends_state` (copies elsewhere). With
        `everywhere=False` only rank 0 gets the tensors (the others its step alone): the
        checkpoint's writer, where every rank holding a whole copy would multiply the host
        memory a checkpoint takes by the ranks."""
        ...

    def lend(self) -> Loan:
        """A loan of the live state (where `lends_state`): the next step's update, and any
        `load_state_dict`, waits until it is `done`."""
        ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Inverse of `state_dict` (a collective call under DeepSpeed)."""
        ...

    def broadcast_json(self, value: Json) -> Json:
        """Rank 0's `value` on every rank (which shards make the batch, for instance)."""
        ...
