"""Learner checkpoints: the backend's state (optimizer moments, critic) as safetensors files
under `learner/ckpt-<step>/`, then `learner/LATEST.json` naming the step; no pickle.

The learner writes a checkpoint before the commit of its version (`progress.json`) and prunes
older ones only after it, so a learner stopped in between finds LATEST naming a step past
its committed version and the checkpoint before it still stored: `committed_checkpoint`
resumes from that one and `repair` makes the store say so.

A file is streamed into the store tensor by tensor (`models.io.write_safetensors` into
`Store.writer`), so no serialized copy of it exists in memory. Its tensors can be the
learner's live state (`CheckpointFiles.loan`): then the backend's next update waits until
they are written, and they are released before the files are committed (renamed into place,
or uploaded from the spool)."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from ..learner_backends.base import Loan
from ..models.io import write_safetensors
from ..store import RunKeys, Store
from ..store.keys import folder_number
from ..store.records import CheckpointPointer


class CheckpointFiles(dict[str, dict[str, torch.Tensor]]):
    """Checkpoint files, name -> tensors. With a `loan` they are the backend's own tensors,
    which it leaves unchanged until `release` (after they are written, or when writing them
    failed or was never reached)."""

    loan: Loan | None = None

    def release(self) -> None:
        if self.loan is not None:
            self.loan.done()


def release(files: dict) -> None:
    """Release the live tensors of `files`, if it holds any (see `CheckpointFiles`)."""
    if isinstance(files, CheckpointFiles):
        files.release()


def save_checkpoint(store: Store, keys: RunKeys, step: int,
                    files: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write `files` (name -> tensors, each as safetensors) under learner/ckpt-<step>/, then
    move LATEST to it (`prune` deletes the old ones once the step is committed).

    Each file is written tensor by tensor from the tensors themselves, and leaves `files` as
    it is written, so (when `files` held the last reference to copies) they are freed file by
    file. Every file is written before any is committed; live tensors are released in between.
    """
    try:
        with ExitStack() as committed:  # on leaving it, every file is in the store
            for name in list(files):
                out = committed.enter_context(
                    store.writer(keys.learner_file(step, f"{name}.safetensors")))
                write_safetensors(out, files.pop(name))
            release(files)
    finally:
        release(files)
    CheckpointPointer(step=step).write(store, keys.latest_learner())


def latest_checkpoint(store: Store, keys: RunKeys) -> int | None:
    """The step of the newest complete checkpoint, or None if there is none."""
    pointer = CheckpointPointer.read(store, keys.latest_learner(), optional=True)
    return pointer.step if pointer is not None else None


def _stored_steps(store: Store, keys: RunKeys) -> list[int]:
    return sorted({s for k in store.list(keys.root + "learner/")
                   if (s := folder_number(k, "learner")) is not None})


def committed_checkpoint(store: Store, keys: RunKeys, version: int,
                         latest: int | None = None) -> int | None:
    """The checkpoint a learner resuming at committed `version` loads: LATEST's (`latest`,
    read when not given), unless it is past `version` (its commit never landed: that step
    will be redone), then the newest stored one at or before `version`, or None if there
    is none."""
    latest = latest_checkpoint(store, keys) if latest is None else latest
    if latest is None or latest <= version:
        return latest
    return max((s for s in _stored_steps(store, keys) if s <= version), default=None)


def repair(store: Store, keys: RunKeys, version: int) -> int | None:
    """Point LATEST at `committed_checkpoint` and delete the checkpoints past `version`
    (written for commits that never landed), so no later resume loads one; that step."""
    latest = latest_checkpoint(store, keys)
    step = committed_checkpoint(store, keys, version, latest)
    for late in (s for s in _stored_steps(store, keys) if s > version):
        for key in store.list(keys.learner_prefix(late)):
            store.delete(key)
    if step != latest:
        if step is None:
            store.delete(keys.latest_learner())
        else:
            CheckpointPointer(step=step).write(store, keys.latest_learner())
    return step


def prune(store: Store, keys: RunKeys, step: int, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never `step`'s)."""
    for old in _stored_steps(store, keys)[:-keep]:
        if old != step:
            for key in store.list(keys.learner_prefix(old)):
                store.delete(key)
