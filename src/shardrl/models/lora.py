"""LoRA adapters on the learner's policy (`learner.lora`, with peft).

The learner injects low-rank adapters into the linear layers it names (`add_lora`): each
adapted weight W (out, in) computes with W + B A * scaling, A (r, in) and B (out, r), where
scaling = alpha / r, B starts at zero (the adapted model starts as the base) and A at
random. Only A and B are trainable; the base weights stay frozen.

Nothing downstream of the learner sees peft. A published version holds plain weights under
the base model's names, the adapted ones merged (`merged_state`), so rollout, evaluation,
deltas and promote work as with full fine-tuning. The KL reference is the frozen base
itself: `adapters_off` disables every adapter for a forward (what peft's
`PeftModel.disable_adapter` does for LoRA), so no copy of the model is kept. The adapters
cannot be recovered from merged weights, so the learner checkpoints them with their AdamW
state at every step (the torch backend's state holds the trainable weights of a policy
that has frozen ones).

peft is imported only when adapters are added or toggled; the other functions find the
adapted layers by their attributes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

ADAPTER = "default"
"""peft's name of the one adapter."""


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float,
             target_modules: list[str], seed: int) -> nn.Module:
    """`model` with LoRA adapters injected in place into the modules whose names end with
    one of `target_modules` (e.g. q_proj), every other parameter frozen; returns `model`.

    The A matrices are drawn from `seed` alone (the global RNG is left as it was), so the
    initial adapters are a function of the config. peft raises a ValueError naming the
    targets when none of them is in the model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                        target_modules=list(target_modules))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config).get_base_model()


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: LoRA layer} of the adapted layers of `model` (empty without adapters)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of `model` as the base model names it, each adapted weight merged:
    W + B A * scaling (peft's `get_delta_weight`). Without adapters, `model.state_dict()`.

    The merged tensors are new; every other tensor is the model's own (not a copy), so tied
    weights stay recognizable by identity (`delta.publish_state` stores them once)."""
    layers = lora_layers(model)
    state = model.state_dict()
    if not layers:
        return state
    merged = {f"{name}.weight": layer.base_layer.weight + layer.get_delta_weight(ADAPTER)
              for name, layer in layers.items()}  # (out, in) each
    out = {}
    for key, t in state.items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = merged.get(key, t)
    return out


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within it `model` computes as its frozen base: every adapter layer is disabled, and
    enabled again on exit (as peft's `disable_adapter` does for LoRA).

    Disabling an adapter also clears its parameters' requires_grad, which enabling sets
    again: run the base forward before the forward whose graph the step backpropagates."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    disabled = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m, off in zip(layers, disabled, strict=True):
            m.enable_adapters(not off)
