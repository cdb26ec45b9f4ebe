"""The plain PyTorch learner backend: one process, one AdamW over the policy (and critic)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

from ..models.heads import Critic
from .base import (
    MOMENTS,
    STEP_KEY,
    CriticModule,
    Json,
    Loan,
    OptimSettings,
    PolicyModule,
    moment_key,
    trainable_parts,
)


class TorchLearnerBackend:
    """`Backend` on a single process. Gradient clipping is global over every trainable part.

    When a part has frozen parameters (LoRA adapters on a frozen base), its state also holds
    the values of its trainable ones (`weight_key`): the published versions hold merged
    weights, from which the adapters cannot be recovered.

    It lends its state: `state_dict(copy=False)` gives the AdamW moments (and trained
    weights) themselves, and an update waits, after the backward pass, for every loan made
    since the last one to be done, so a checkpoint is written from the live tensors while
    the next step's forward and backward passes run, without a copy of them."""

    rank = 0
    world_size = 1
    lends_state = True

    def __init__(self, lm: nn.Module, settings: OptimSettings, critic: Critic | None = None,
                 share_prompts: bool = False):
        self.policy = PolicyModule(lm, share_prompts)
        self.critic = CriticModule(critic) if critic is not None else None
        self.parts = trainable_parts(self.policy.lm, critic)
        self.grad_clip = settings.grad_clip
        self.opt = torch.optim.AdamW(settings.param_groups(self.parts), lr=settings.lr,
                                     betas=settings.betas, weight_decay=settings.weight_decay)
        self.params = [p for group in self.opt.param_groups for p in group["params"]]
        self.loans: list[Loan] = []

    def set_lr(self, part: str, lr: float) -> None:
        for group in self.opt.param_groups:
            if group["name"] == part:
                group["lr"] = lr

    def step(self, loss: Tensor | Iterable[Tensor]) -> tuple[bool, float]:
        """One optimizer step on `loss`, or on the sum of the micro-batch losses an iterable
        yields (each one's backward runs before the next is computed)."""
        return apply_step(loss, self.params, [self.opt], self.grad_clip,
                          before_update=self._loans_done)

    def lend(self) -> Loan:
        loan = Loan()
        self.loans.append(loan)
        return loan

    def _loans_done(self) -> None:
        """Wait until no reader reads the state any more (before changing it)."""
        while self.loans:
            self.loans[0].wait()
            self.loans.pop(0)

    def gathered(self) -> AbstractContextManager[None]:
        return nullcontext()

    def state_dict(self, copy: bool = True, everywhere: bool = True) -> dict[str, Tensor]:
        state: dict[str, Tensor] = {}
        step = 0.0

        def out(t: Tensor) -> Tensor:
            return t.detach().cpu().clone() if copy else t.detach()

        for part, module in self.parts.items():
            for name, param in _trained_weights(module):
                state[weight_key(part, name)] = out(param)
            for name, param in module.named_parameters():
                slots = self.opt.state.get(param)
                if not slots:
                    continue
                step = float(slots["step"])
                for slot in MOMENTS:
                    state[moment_key(part, name, slot)] = out(slots[slot])
        state[STEP_KEY] = torch.tensor(step, dtype=torch.float32)
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._loans_done()
        missing = []
        with torch.no_grad():
            for part, module in self.parts.items():
                for name, param in _trained_weights(module):
                    if (key := weight_key(part, name)) in state:
                        param.copy_(state[key])
                    else:
                        missing.append(key)
        step = state[STEP_KEY].to(torch.float32)
        if float(step) == 0 and not missing:  # saved before the first update: no moments yet
            return
        for part, module in self.parts.items():
            for name, param in module.named_parameters():
                if not param.requires_grad:
                    continue
                keys = [moment_key(part, name, slot) for slot in MOMENTS]
                missing += [k for k in keys if k not in state]
                if all(k in state for k in keys):
                    self.opt.state[param] = {
                        "step": step.clone(),
                        **{slot: state[k].to(param.device, param.dtype).clone()
                           for slot, k in zip(MOMENTS, keys, strict=True)},
                    }
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} entries, e.g. {missing[:3]}")

    def broadcast_json(self, value: Json) -> Json:
        return value


def weight_key(part: str, param_name: str) -> str:
    """State key of a trained weight of a partly frozen part, e.g.
    `policy/model.layers.0.self_attn.q_proj.lora_A.default.weight/weight`."""
    return f"{part}/{param_name}/weight"


def _trained_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable named parameters of `module` when some of its parameters are frozen
    (adapters on a frozen base); none when every parameter trains."""
    named = list(module.named_parameters())
    if all(p.requires_grad for _, p in named):
        return []
    return [(name, p) for name, p in named if p.requires_grad]


def apply_step(loss: torch.Tensor | Iterable[torch.Tensor], params: list[torch.nn.Parameter],
               optimizers, grad_clip: float | None,
               before_update: Callable[[], None] | None = None) -> tuple[bool, float]:
    """Backward, clip and step; skips (and reports False) on a non-finite loss or gradient.

    `loss` may be an iterable of micro-batch losses: their gradients accumulate, and a
    non-finite one skips the whole step. `before_update` runs right before the optimizers
    change the parameters and their state (when they do)."""
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    for part in [loss] if isinstance(loss, torch.Tensor) else loss:
        if not torch.isfinite(part):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            return False, math.nan
        part.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else math.inf)
    if not torch.isfinite(norm):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return False, float(norm)
    if before_update is not None:
        before_update()
    for opt in optimizers:
        opt.step()
    return True, float(norm)
