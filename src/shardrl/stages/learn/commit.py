"""What the learner has committed (the ledger) and the ordered store writes of a commit."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import torch

from ...store import RunKeys, Store, parse_shard_key
from ...store.keys import shard_name
from ...store.records import Buffered, LearnerRestart, LedgerDelta, LedgerEntry, Progress
from ..checkpoint import prune, release, save_checkpoint
from .buffer import Batch, tally
from .offload import CommitProcess, Point, Publish, Put, Write, Writes


class Ledger:
    """Sample counts, per-worker shard and group counts, the lag histogram and the shard
    names committed per open version: the learner's resumable state (`Progress`)."""

    def __init__(self, state: Progress) -> None:
        self.commits = state.commits
        self.counts = Counter(state.counts)
        self.by_worker = Counter(state.processed_by_worker)
        self.groups_by_worker = Counter(state.groups_by_worker)
        self.kept_by_worker = Counter(state.kept_groups_by_worker)
        self.staleness = Counter(state.staleness)
        self.names: dict[int, list[str]] = {v: list(n) for v, n in state.ledger.items()}

    def handled(self, version: int) -> set[str]:
        """Names of the shards of `version` already committed (the scanner skips them)."""
        return set(self.names.get(version, ()))

    def lags(self, version: int, table: pa.Table) -> None:
        """Count the samples a step at learner `version` admitted within the staleness
        bound by their lag: the ones filtered after admission (zero variance) included."""
        for entry in pc.value_counts(table.column("policy_version")).to_pylist():
            self.staleness[version - entry["values"]] += entry["counts"]

    def record(self, batch: Batch,
               tallies: dict[str, tuple[int, int, int]] | None = None) -> list[LedgerEntry]:
        """Count a commit's shards; its ledger delta. `tallies`: (worker, prompt groups, kept
        groups) of shards already counted when they were read (the others are counted here)."""
        tallies = tallies or {}
        delta = []
        for key, table, outcome in batch:
            sk = parse_shard_key(key)
            rows = len(table)
            if outcome == "stale":
                self.counts["stale_dropped"] += rows
            else:
                kept = int(pc.sum(table.column("keep")).as_py() or 0)
                self.counts["consumed"] += kept
                self.counts["filtered"] += rows - kept
            self.by_worker[sk.worker] += 1
            self.names.setdefault(sk.version, []).append(shard_name(key))
            delta.append(LedgerEntry(key=key, outcome=outcome, rows=rows))
        self.groups_by_worker, self.kept_by_worker = self.groups_with(batch, tallies)
        self.commits += 1
        return delta

    def groups_with(self, batch: Batch, tallies: dict[str, tuple[int, int, int]] | None = None,
                    ) -> tuple[Counter[int], Counter[int]]:
        """Prompt groups and kept groups per rollout worker, committed so far plus `batch`'s
        (`tallies` as in `record`)."""
        groups, kept = Counter(self.groups_by_worker), Counter(self.kept_by_worker)
        for key, table, _ in batch:
            worker, n_groups, n_kept = (tallies or {}).get(key) or tally(key, table)
            groups[worker] += n_groups
            kept[worker] += n_kept
        return groups, kept

    def forget_below(self, low: int) -> None:
        """Drop the names of closed versions (below the scanner's cursor)."""
        self.names = {v: names for v, names in self.names.items() if v >= low}

    def progress(self, version: int, kl: dict[str, float], beta: float,
                 no_signal: dict[str, float] | None = None) -> Progress:
        return Progress(
            version=version, commits=self.commits, counts=dict(self.counts),
            processed_by_worker=dict(self.by_worker), groups_by_worker=dict(self.groups_by_worker),
            kept_groups_by_worker=dict(self.kept_by_worker), staleness=dict(self.staleness),
            ledger={v: list(n) for v, n in self.names.items()}, kl=kl, beta=beta,
            no_signal=no_signal or {}, time=time.time())


@dataclass
class Commit:
    """Everything one commit writes, captured when it is made."""

    progress: Progress
    delta: list[LedgerEntry]
    stepped: bool
    weights: dict[str, torch.Tensor] | None = None
    """The new version's weights in the publish dtype (an applied step)."""
    full_every: int = 1
    """`learner.publish.full_every`."""
    checkpoint: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Checkpoint files (name -> tensors, serialized by `write`) when one is due (may be the
    backend's live tensors: `checkpoint.CheckpointFiles`)."""
    buffered: Buffered | None = None
    """Groups read and not committed (rollout workers that cannot count kept groups)."""
    beta: float | None = None
    threads: list[int] = field(default_factory=list)
    restart: LearnerRestart | None = None
    applied: bool | None = None
    """The ledger delta's replay fields (see `LedgerDelta`)."""

    def write(self, out: Writes | CommitProcess, store: Store, keys: RunKeys,
              keep_checkpoints: int, collect: Callable[[int], object]) -> None:
        """The store writes, in the commit order (see the package docstring): `out` runs all
        but the checkpoint's (here or in its child process, see `offload`). Live checkpoint
        tensors are released however it ends."""
        try:
            self._write(out, store, keys, keep_checkpoints, collect)
        finally:
            release(self.checkpoint)

    def _write(self, out: Writes | CommitProcess, store: Store, keys: RunKeys,
               keep_checkpoints: int, collect: Callable[[int], object]) -> None:
        version = self.progress.version
        before: list[Write] = []
        if self.weights is not None:
            before.append(Publish(version, self.weights, self.full_every))
        before.append(Put(keys.ledger(self.progress.commits), LedgerDelta(
            version=version, stepped=self.stepped, applied=self.applied, shards=self.delta,
            beta=self.beta, threads=self.threads, restart=self.restart)))
        if self.buffered is not None:  # before progress.json: a reader double-counts, never misses
            before.append(Put(keys.buffered(), self.buffered))
        after: list[Write] = [Put(keys.progress(), self.progress)]
        if self.stepped:
            after.append(Point(version))
        if self.checkpoint:
            out.run(before)
            save_checkpoint(store, keys, version, self.checkpoint)
            out.run(after)
            # only now: a learner stopped before progress.json resumes from the one before
            prune(store, keys, version, keep_checkpoints)
        else:
            out.run(before + after)
        if self.stepped:
            collect(version)


class Writer:
    """Store writes on one background thread, in order; at most one commit in flight."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learn-commit")
        self.pending: list[Future] = []

    def submit(self, write: Callable, *args) -> None:
        """Queue `write(*args)` behind the writes in flight, which must end first."""
        self.wait()
        self.pending.append(self.pool.submit(write, *args))

    def later(self, write: Callable, *args) -> None:
        """Queue `write(*args)` behind the writes in flight without waiting for them: small
        work that must follow the last commit (the scan cursor, the doctor's check) but need
        not hold up the step. It is skipped if a write queued before it failed: a cursor
        that closes a version must not land when the commit naming its last shards did not.
        Its error, or the earlier one, is raised by the next `submit` or `wait`."""
        before = list(self.pending)

        def after_them() -> None:
            # the one thread runs in order: every earlier write has ended by now
            if not any(f.exception() is not None for f in before):
                write(*args)

        self.pending.append(self.pool.submit(after_them))

    def check(self) -> None:
        """Raise the error of a write that has failed, without waiting for one in flight: a
        learner waiting for data polls this, since workers held at their cap by a commit that
        never landed would leave it waiting for ever."""
        if any(f.done() and f.exception() is not None for f in self.pending):
            self.wait()

    def wait(self) -> None:
        """Wait for the writes in flight; the first error, if any, is raised here."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)
