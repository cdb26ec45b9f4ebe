"""Learner checkpoints: the backend's state (optimizer moments, critic) as safetensors files
under `learner/ckpt-<step>/`, then `learner/LATEST.json` naming the step; no pickle."""

from __future__ import annotations

import torch
from safetensors.torch import save as st_save

from ..store import RunKeys, Store
from ..store.keys import folder_number
from ..store.records import CheckpointPointer


def save_checkpoint(store: Store, keys: RunKeys, step: int,
                    files: dict[str, dict[str, torch.Tensor]], keep: int) -> None:
    """Write `files` (name -> tensors, each as safetensors) under learner/ckpt-<step>/, then
    move LATEST to it and delete all but the newest `keep` checkpoints.

    Each file's tensors leave `files` as it is serialized, so (when `files` held the last
    reference) at most one file exists twice in memory, as tensors and as bytes."""
    for name in list(files):
        data = st_save(files.pop(name))
        store.put_bytes(keys.learner_file(step, f"{name}.safetensors"), data)
        del data
    CheckpointPointer(step=step).write(store, keys.latest_learner())
    _prune(store, keys, step, keep)


def latest_checkpoint(store: Store, keys: RunKeys) -> int | None:
    """The step of the newest complete checkpoint, or None if there is none."""
    pointer = CheckpointPointer.read(store, keys.latest_learner(), optional=True)
    return pointer.step if pointer is not None else None


def _prune(store: Store, keys: RunKeys, step: int, keep: int) -> None:
    steps = sorted({s for k in store.list(keys.root + "learner/")
                    if (s := folder_number(k, "learner")) is not None})
    for old in steps[:-keep]:
        if old != step:
            for key in store.list(keys.learner_prefix(old)):
                store.delete(key)
