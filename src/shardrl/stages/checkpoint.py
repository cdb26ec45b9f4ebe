"""Learner checkpoints: the backend's state (optimizer moments, critic) as safetensors files
under `learner/ckpt-<step>/`, then `learner/LATEST.json` naming the step; no pickle."""

from __future__ import annotations

from ..store import RunKeys, Store
from ..store.keys import folder_number
from ..store.records import CheckpointPointer


def save_checkpoint(store: Store, keys: RunKeys, step: int, files: dict[str, bytes],
                    keep: int) -> None:
    """Write `files` (name -> safetensors bytes) under learner/ckpt-<step>/, then move
    LATEST to it and delete all but the newest `keep` checkpoints."""
    for name, data in files.items():
        store.put_bytes(keys.learner_file(step, f"{name}.safetensors"), data)
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
