"""Which optimizer checkpoint a resumed learner loads when it stopped between writing a
checkpoint and committing its version, and the commit order that keeps the one before."""

from __future__ import annotations

import pytest
import torch

from shardrl.stages.checkpoint import (
    committed_checkpoint,
    latest_checkpoint,
    prune,
    repair,
    save_checkpoint,
)
from shardrl.stages.learn.commit import Commit
from shardrl.stages.learn.offload import Put, Writes
from shardrl.store import LocalStore, RunKeys
from shardrl.store.keys import folder_number
from shardrl.store.records import Progress

KEYS = RunKeys("r1")


def saved(store, *steps: int) -> None:
    for step in steps:
        save_checkpoint(store, KEYS, step, {"backend": {"step": torch.tensor(float(step))}})


def stored(store) -> list[int]:
    return sorted({s for k in store.list(KEYS.root + "learner/")
                   if (s := folder_number(k, "learner")) is not None})


def test_latest_is_taken_when_it_is_committed(tmp_path):
    store = LocalStore(tmp_path)
    assert committed_checkpoint(store, KEYS, 5) is None
    saved(store, 2, 4)
    assert committed_checkpoint(store, KEYS, 4) == 4
    assert committed_checkpoint(store, KEYS, 7) == 4  # resumed between checkpoints


def test_a_checkpoint_past_the_committed_version_is_passed_over_and_removed(tmp_path):
    store = LocalStore(tmp_path)
    saved(store, 2, 4, 6)  # 6 written, its commit never landed: progress.json says 5
    assert latest_checkpoint(store, KEYS) == 6
    assert committed_checkpoint(store, KEYS, 5) == 4
    assert repair(store, KEYS, 5) == 4
    assert latest_checkpoint(store, KEYS) == 4 and stored(store) == [2, 4]
    # nothing at or before the version: no pointer at all, not one to a later trajectory
    saved(store, 9)
    assert repair(store, KEYS, 1) is None
    assert latest_checkpoint(store, KEYS) is None and stored(store) == []


class FailingProgress(Writes):
    """Runs writes here, failing at progress.json (a learner stopped just before it)."""

    def run(self, writes) -> None:
        for w in writes:
            if isinstance(w, Put) and w.key == KEYS.progress():
                raise OSError("stopped before progress.json")
        super().run(writes)


def test_pruning_waits_for_the_commit_so_the_checkpoint_before_survives(tmp_path):
    store = LocalStore(tmp_path)
    saved(store, 2)
    prune(store, KEYS, 2, keep=1)
    commit = Commit(progress=Progress(version=4, commits=4), delta=[], stepped=False,
                    checkpoint={"backend": {"step": torch.tensor(4.0)}})
    with pytest.raises(OSError, match="progress.json"):
        commit.write(FailingProgress(store, KEYS), store, KEYS, 1, lambda version: None)
    # keep=1, yet step 2 is still there: a learner resuming at version 3 loads it
    assert latest_checkpoint(store, KEYS) == 4 and stored(store) == [2, 4]
    assert committed_checkpoint(store, KEYS, 3) == 2
    # the same commit landing prunes down to `keep`
    commit = Commit(progress=Progress(version=4, commits=4), delta=[], stepped=False,
                    checkpoint={"backend": {"step": torch.tensor(4.0)}})
    commit.write(Writes(store, KEYS), store, KEYS, 1, lambda version: None)
    assert stored(store) == [4] and store.exists(KEYS.progress())


def test_an_older_checkpoint_gives_its_moments_not_its_policy_masters():
    """DeepSpeed's bf16 state carries the float32 masters, which the engine copies into the
    weights at the next update: from a checkpoint older than the committed version they
    would put the policy back to that step. The critic's come with its own weights, from
    the same checkpoint, so they stay."""
    import torch

    from shardrl.stages.learn.loop import resumable_state

    state = {"step": torch.tensor(10.0), "policy/w/exp_avg": torch.ones(2),
             "policy/w/fp32": torch.ones(2), "critic/v/fp32": torch.ones(1)}
    assert resumable_state(state, 17, 17) is state
    assert set(resumable_state(state, 10, 17)) == {"step", "policy/w/exp_avg", "critic/v/fp32"}


def test_an_older_checkpoint_read_lazily_reads_each_entry_once_and_only_when_taken():
    """A resume from a checkpoint before the committed version (most resumes: one every
    `ckpt_every` versions) asks the state whether it holds each entry, then takes it: the
    question must not read the tensor."""
    import torch
    from safetensors.torch import save as st_save

    from shardrl.models.io import StoredSafetensors
    from shardrl.stages.learn.loop import resumable_state

    data = st_save({"step": torch.tensor(10.0), "policy/w/exp_avg": torch.ones(2),
                    "policy/w/fp32": torch.ones(2), "critic/v/fp32": torch.ones(1)})
    reads: list[int] = []

    def read(offset: int, length: int) -> bytes:
        reads.append(offset)
        return data[offset:offset + length]

    state = resumable_state(StoredSafetensors(read, "ckpt"), 10, 17)
    reads.clear()
    assert "policy/w/exp_avg" in state and "policy/w/fp32" not in state
    assert state.get("policy/w/fp32") is None and len(state) == 3
    assert reads == []
    assert torch.equal(state["policy/w/exp_avg"], torch.ones(2)) and len(reads) == 1
