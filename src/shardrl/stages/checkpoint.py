"""Learner checkpoints without pickle: optimizer tensors in safetensors, structure in JSON."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..store import RunKeys, Store


def optimizer_to_bytes(opt: torch.optim.Optimizer) -> tuple[bytes, dict]:
    state = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, slots in state["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return st_save(tensors) if tensors else b"", {"param_groups": state["param_groups"],
                                                  "scalars": scalars}


def optimizer_from_bytes(opt: torch.optim.Optimizer, data: bytes, meta: dict) -> None:
    tensors = st_load(data) if data else {}
    slots: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        slots.setdefault(int(pid), {})[name] = value
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})


def save_checkpoint(store: Store, keys: RunKeys, step: int, optimizers: dict[str, torch.optim.Optimizer],
                    extra_weights: dict[str, bytes], keep: int) -> None:
    """learner/ckpt-<step>/: one safetensors + JSON per optimizer, extra weights; then LATEST."""
    meta = {}
    for name, opt in optimizers.items():
        data, info = optimizer_to_bytes(opt)
        store.put_bytes(keys.learner_file(step, f"{name}.safetensors"), data)
        meta[name] = info
    for name, data in extra_weights.items():
        store.put_bytes(keys.learner_file(step, f"{name}.safetensors"), data)
    store.put_bytes(keys.learner_file(step, "optimizers.json"), json.dumps(meta).encode())
    store.put_json(keys.latest_learner(), {"step": step})
    _prune(store, keys, step, keep)


def load_checkpoint(store: Store, keys: RunKeys, optimizers: dict[str, torch.optim.Optimizer]) -> int | None:
    """Restore optimizer states from the newest checkpoint; its step, or None if there is none."""
    if not store.exists(keys.latest_learner()):
        return None
    step = int(store.get_json(keys.latest_learner())["step"])
    meta = json.loads(store.get_bytes(keys.learner_file(step, "optimizers.json")))
    for name, opt in optimizers.items():
        optimizer_from_bytes(opt, store.get_bytes(keys.learner_file(step, f"{name}.safetensors")),
                             meta[name])
    return step


def _prune(store: Store, keys: RunKeys, step: int, keep: int) -> None:
    prefix = keys.root + "learner/"
    steps = sorted({int(k[len(prefix):].split("/")[0][5:]) for k in store.list(prefix)
                    if k[len(prefix):].startswith("ckpt-")})
    for old in steps[:-keep]:
        if old != step:
            for key in store.list(keys.learner_prefix(old)):
                store.delete(key)
