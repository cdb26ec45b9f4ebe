"""Learner checkpoints: the backend's state (optimizer moments, critic) as safetensors files
under `learner/ckpt-<step>/`, then `learner/LATEST.json` naming the step; no pickle."""

from __future__ import annotations

from ..store import RunKeys, Store


def save_checkpoint(store: Store, keys: RunKeys, step: int, files: dict[str, bytes],
                    keep: int) -> None:
    """Write `files` (name -> safetensors bytes) under learner/ckpt-<step>/, then move
    LATEST to it and delete all but the newest `keep` checkpoints."""
    for name, data in files.items():
        store.put_bytes(keys.learner_file(step, f"{name}.safetensors"), data)
    store.put_json(keys.latest_learner(), {"step": step})
    _prune(store, keys, step, keep)


def latest_checkpoint(store: Store, keys: RunKeys) -> int | None:
    """The step of the newest complete checkpoint, or None if there is none."""
    if not store.exists(keys.latest_learner()):
        return None
    return int(store.get_json(keys.latest_learner())["step"])


def _prune(store: Store, keys: RunKeys, step: int, keep: int) -> None:
    prefix = keys.root + "learner/"
    steps = sorted({int(k[len(prefix):].split("/")[0][5:]) for k in store.list(prefix)
                    if k[len(prefix):].startswith("ckpt-")})
    for old in steps[:-keep]:
        if old != step:
            for key in store.list(keys.learner_prefix(old)):
                store.delete(key)
