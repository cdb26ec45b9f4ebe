"""Lending a machine's cores to whichever stages are busy (local runs on CPU).

On a cluster each stage has its own pod or GPU. On one machine the stages share its cores,
and a fixed split wastes them: while the learner waits for data its threads idle, and while
the generator is paused by its backlog the learner could use them. The local runner makes a
directory (`SHARDRL_CORE_SHARE`) and tells each stage how many cores it may use
(`SHARDRL_CORES`). A stage marks itself busy around its heavy work (generation, an update,
an evaluation) with an empty file named after its process id; a busy stage runs on
`cores // busy_stages` threads (at least its configured floor) and rechecks at the
points it calls `adjust()`, for instance between the forward and the backward pass.

Without those variables (a pod, a test) `busy()` only keeps the configured thread count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..lifetime import running

SHARE_ENV, CORES_ENV = "SHARDRL_CORE_SHARE", "SHARDRL_CORES"


def fair_threads(cores: int, busy: int, floor: int) -> int:
    """Threads for one of `busy` busy stages on `cores` cores: an equal share, >= floor."""
    return max(floor, cores // max(busy, 1))


class CoreShare:
    """This process's share of the machine's cores (see the module docstring)."""

    def __init__(self, root: Path | None, cores: int, floor: int) -> None:
        self.root, self.cores, self.floor = root, cores, floor
        self.marker = root / str(os.getpid()) if root is not None else None
        import torch  # here: the runner reads this module's names without loading torch

        self.threads = torch.get_num_threads()

    @classmethod
    def from_env(cls, floor: int) -> CoreShare:
        """The runner's share directory and core count, or a fixed share of `floor` threads."""
        root = os.environ.get(SHARE_ENV)
        cores = int(os.environ.get(CORES_ENV, floor))
        if not root or not Path(root).is_dir():
            return cls(None, floor, floor)
        return cls(Path(root), cores, floor)

    def busy_stages(self) -> int:
        """Busy stages right now, this one included when it is busy; dead markers removed."""
        if self.root is None:
            return 1
        count = 0
        for marker in self.root.iterdir():
            if not marker.name.isdigit():
                continue
            if running(int(marker.name)):
                count += 1
            else:
                marker.unlink(missing_ok=True)
        return count

    def adjust(self) -> int:
        """Set this process's torch threads to its current share; returns it."""
        threads = self.floor if self.root is None else fair_threads(self.cores,
                                                                    self.busy_stages(), self.floor)
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    @contextmanager
    def busy(self) -> Iterator[CoreShare]:
        """Mark this stage busy for the block, at its share of the cores."""
        if self.marker is None:
            yield self
            return
        self.marker.touch()
        try:
            self.adjust()
            yield self
        finally:
            self.marker.unlink(missing_ok=True)
