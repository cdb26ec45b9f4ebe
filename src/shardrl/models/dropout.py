"""Dropout off for RL training.

The learner's logprobs are compared with the sampling engine's (the ratio, the engines'
mismatch, the importance weights), and the engines sample with dropout off. A dropout mask in
the learner's forward makes every such ratio noisy, and a resumed or replayed learner would
draw other masks than the run did. So the learner trains with every dropout at 0, as RL
trainers for language models do; LoRA's own dropout on the adapters' input is kept (it is
seeded per step, see `learn.loop`).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.dropout import _DropoutNd

CONFIG_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "summary_first_dropout", "activation_dropout", "dropout",
                 "hidden_dropout_prob", "attention_probs_dropout_prob")
"""Dropout probabilities of transformers' model configs (what layers built later read)."""
MODULE_FIELDS = ("attention_dropout", "dropout", "dropout_p")
"""Float dropout probabilities modules keep as attributes (attention layers that pass one to
`scaled_dot_product_attention` while training)."""
KEEP = "lora_dropout"
"""Modules under this name keep their dropout."""


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability in `model` (modules and config) to 0, LoRA's excepted;
    the number of modules whose dropout was on."""
    changed = 0
    for name, module in model.named_modules():
        if KEEP in name:
            continue
        hit = False
        if isinstance(module, _DropoutNd) and module.p:
            module.p, hit = 0.0, True
        for field in MODULE_FIELDS:
            value = getattr(module, field, None)
            if isinstance(value, float) and value > 0.0:
                setattr(module, field, 0.0)
                hit = True
        config = getattr(module, "config", None)
        for field in CONFIG_FIELDS if config is not None else ():
            value = getattr(config, field, None)
            if isinstance(value, float) and value > 0.0:
                setattr(config, field, 0.0)
        changed += hit
    return changed
