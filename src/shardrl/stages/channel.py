"""New weights handed from the learner to the rollout workers of one machine, ahead of the
commit (`pipeline.local.weights_channel`).

The local runner gives the stages one folder (`ENV`; in shared memory where the machine has
it), holds it locked while the run runs and removes it when the run ends (a runner that was
killed leaves it behind: the next runner that makes a channel folder in the same place
removes it, `sweep`). At each commit call the learner writes the new
version's weights there (safetensors, then a `version` file naming it: a rename each, no
fsync) before the commit's store writes, which take it about 10 ms more to land; a rollout
worker that wants a version newer than the store's takes it from the folder. The store
stays the record: the channel holds the last `KEEP` versions and nothing else; the runner
empties it when its next check (every half second) sees the learner fail, before the
restart's backoff, and a learner empties it as it starts, so a
worker never takes a version from it that a restarted learner has not made (one it took
before that learner's crash is the one difference: the worker samples with it until the
store holds a newer version than its number, about two steps after the restart, and those
shards name a version the new learner makes again from its own batch; they train as any
sample does, on their recorded log-probabilities). The channel is only a shortcut: a version the folder refuses (shared
memory full) is logged and skipped, and the workers wait for its commit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ENV = "SHARDRL_WEIGHTS_CHANNEL"
"""The folder's path, set by the local runner for the stages it starts."""
KEEP = 2
"""Versions the folder holds."""
MAX_BYTES = 64 << 20
"""Largest weights the learner writes there, on its step's path (the demo's: under 1 MiB)."""
PREFIX = "shardrl-weights-"
"""Start of a channel folder's name (see `sweep`)."""

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.refused = 0
        """Versions `publish` could not write."""

    @classmethod
    def from_env(cls) -> Channel | None:
        """The channel the local runner set up for this run, or None (off, or not local)."""
        path = os.environ.get(ENV)
        return cls(path) if path and Path(path).is_dir() else None

    def _file(self, version: int) -> Path:
        return self.path / f"v{version:08d}.safetensors"

    def _replace(self, name: str, data: bytes) -> None:
        tmp = self.path / f".{name}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path / name)
        finally:
            tmp.unlink(missing_ok=True)

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> bool:
        """Write `version`'s weights, then name it; False when nothing was named: the
        weights are larger than `MAX_BYTES`, or the folder refused them (full shared memory:
        the channel is only a shortcut, so the learner goes on and workers wait for the
        commit)."""
        if sum(t.numel() * t.element_size() for t in weights.values()) > MAX_BYTES:
            return False
        try:
            self._replace(self._file(version).name,
                          st_save({k: t.detach().contiguous() for k, t in weights.items()}))
            self._replace("version", str(version).encode())
        except OSError as exc:
            self._file(version).unlink(missing_ok=True)
            if not self.refused:  # once: a full folder stays full for a while
                log.warning("weights channel %s: version %d not written (%s); until it can "
                            "be, workers take new versions from the store", self.path,
                            version, exc)
            self.refused += 1
            return False
        self._file(version - KEEP).unlink(missing_ok=True)
        return True

    def latest(self) -> int | None:
        """The newest version in the folder, or None."""
        try:
            return int((self.path / "version").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def load(self, version: int) -> dict[str, torch.Tensor] | None:
        """`version`'s weights, or None once they are gone (a newer one replaced them)."""
        try:
            return st_load(self._file(version).read_bytes())
        except FileNotFoundError:
            return None

    def clear(self) -> None:
        """Remove every version and any half-written file (before a learner starts, and as
        it starts: the store is the record)."""
        (self.path / "version").unlink(missing_ok=True)
        for pattern in ("v*.safetensors", ".*.tmp"):
            for entry in self.path.glob(pattern):
                entry.unlink(missing_ok=True)


LOCK = ".lock"
"""A file in each channel folder that its runner holds locked (`flock`) while it runs."""
STALE_UNLOCKED_S = 60.0
"""A folder without a lock file is a runner's that had not locked it yet, or one from an
older layout: swept once it is this old."""


def make(parent: str | Path | None = None) -> tuple[Path, int]:
    """A new channel folder for this process's run, in shared memory where the machine has
    it, after removing the folders of runners that are gone (`sweep`): (folder, descriptor
    of its lock, to keep open while the run runs and close at its end)."""
    if parent is None:
        parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    sweep(parent)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return folder, fd


def sweep(parent: str | Path) -> list[Path]:
    """Remove the channel folders in `parent` that no running runner holds (one killed
    before it could remove its own): a folder's lock is free once every process that held
    it is gone, whatever namespace it ran in; returns those removed."""
    gone = []
    for folder in Path(parent).glob(f"{PREFIX}*"):
        try:
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                if time.time() - folder.stat().st_mtime < STALE_UNLOCKED_S:
                    continue
            except OSError:
                continue
        except OSError:  # another user's, say: not ours to judge
            continue
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its runner runs
                continue
            finally:
                os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            gone.append(folder)
    return gone
