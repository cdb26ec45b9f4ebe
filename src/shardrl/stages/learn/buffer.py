"""The ready shards the learner has read and not yet committed, and the batching rule.

The learner lists new shards itself (the ledger it checks them against changes only on its
thread) and decodes them on a reader thread, so shards that arrive during an update are read
while it runs: a step whose batch is already buffered does not wait for the newer shards'
reads. Reads finish in listing order, and a shard counts as buffered only once it is read.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc

from ...store import parse_shard_key
from ...store.records import Buffered
from ...store.schemas import READY
from ...store.shards import read_or_quarantine
from ..context import StageContext
from ..inline import kept_groups
from ..scan import Scanner
from ..staleness import admitted, step_ready
from .profile import Profile

Batch = list[tuple[str, pa.Table, str]]
"""(key, table, outcome) of the shards one commit records: "admitted" or "stale"."""

COLUMNS = ["group_id", "policy_version", "prompt_token_ids", "response_token_ids",
           "behavior_logprobs", "ref_logprobs", "reward_total", "correct", "advantage", "keep",
           "created_at"]
"""The ready-shard columns the learner uses (the update's, the ledger's and the batching
rule's, the hop and run-end checks'), the only ones it decodes (`decode_shard`); a
multi-turn shard's episode columns come after them. The text columns are for people and
the doctor."""


def tally(key: str, table: pa.Table) -> tuple[int, int, int]:
    """(rollout worker, prompt groups, groups kept by filtering) of the ready shard at `key`."""
    return (parse_shard_key(key).worker, len(pc.unique(table.column("group_id"))),
            kept_groups(table))


class ReadyBuffer:
    """Finds and reads new ready shards (oldest version first) and cuts them into batches."""

    def __init__(self, ctx: StageContext, scanner: Scanner, profile: Profile) -> None:
        self.ctx, self.scanner, self.profile = ctx, scanner, profile
        self.arrivals = ctx.store.watch(ctx.keys.kind_prefix("ready"))
        self.items: list[tuple[str, pa.Table]] = []
        """(key, table) of read shards not yet committed, oldest version first."""
        self.tallies: dict[str, tuple[int, int, int]] = {}
        """(worker, prompt groups, groups kept by filtering) of each buffered shard, counted
        once, on the reader thread, when it is read (`counts` runs at every commit and
        `next_batch` at every poll, over the whole buffer)."""
        self.waiting = False
        """Whether the learner waited for data just before the current read."""
        self.unlisted = True
        """Whether shards may have arrived that no listing has seen: at the start and after
        every wait (a wake-up the watch missed costs one wait, as before). Between steps
        that do not wait, the store is listed only when the watch reports a commit."""
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learn-read")
        self.reads: list[tuple[str, bool, Future]] = []
        """(key, listed while waiting for data, its read) of listed shards not yet buffered,
        in listing order."""

    def poll(self, version: int, block: bool = False) -> bool:
        """List the shards that appeared up to `version` and start reading them; buffer the
        reads that are done (all of them with `block`). Whether anything was buffered."""
        if self.unlisted or self.arrivals.changed():
            self.unlisted = False
            known = {k for k, _ in self.items} | {k for k, _, _ in self.reads}
            new = [k for k in self.scanner.poll(version) if k not in known]
            self.reads += [(key, self.waiting, self.reader.submit(self._read, key))
                           for key in new]
            if new:
                self.arrivals.reset()
        self.waiting = False
        return self.collect(block)

    def reading(self) -> bool:
        """Whether listed shards are still being read."""
        return bool(self.reads)

    def collect(self, block: bool, first: bool = False) -> bool:
        """Buffer the finished reads at the front of the queue (every read with `block`; with
        `first`, the front read, waited for, and those after it that are done); whether any
        was buffered. A read's error is raised here."""
        buffered = False
        while self.reads and (block or first or self.reads[0][2].done()):
            first = False
            key, waited, future = self.reads.pop(0)
            started = time.monotonic()
            table, tally = future.result()
            self.profile.read_s += time.monotonic() - started  # the wait for it, if any
            if table is None:
                self.ctx.log.warning("quarantined %s", key)
                continue
            if waited:
                self.profile.hops.append(time.time() - pc.max(table.column("created_at")).as_py())
            self.items.append((key, table))
            self.tallies[key] = tally
            buffered = True
        return buffered

    def _read(self, key: str) -> tuple[pa.Table | None, tuple[int, int, int] | None]:
        """A ready shard and its tally (worker, prompt groups, groups kept by filtering),
        counted here on the reader thread; (None, None) once it is quarantined."""
        table = read_or_quarantine(self.ctx.store, key, READY, "learn", COLUMNS)
        if table is None:
            return None, None
        return table, tally(key, table)

    def close(self) -> None:
        self.reader.shutdown(wait=True, cancel_futures=True)

    def wait(self, timeout: float) -> None:
        """Wait for a new ready shard (or `timeout`)."""
        started = time.monotonic()
        self.arrivals.wait(timeout)
        self.profile.wait_s += time.monotonic() - started
        self.waiting = self.unlisted = True

    @staticmethod
    def outcome(key: str, version: int, k: int) -> str:
        """"stale" if the shard's policy version lags `version` by more than `k`."""
        return "admitted" if admitted(version, parse_shard_key(key).version, k) else "stale"

    def next_batch(self, version: int, k: int, batch_prompts: int) -> Batch | None:
        """The shards (from the front) that make the next step, None if too few.

        A step takes shards in order until `batch_prompts` prompt groups kept by filtering are
        in (ScaleRL's effective batch), or a long run of filtered ones (`staleness.step_ready`:
        from all rollout workers together or from one of them); stale shards on the way are dropped
        with it. Shards past that point wait for the next step, so a backlog (after a restart,
        say) makes several steps of size B rather than one huge one. A prompt group lives in
        one shard, so the counts are the shards' tallies summed.
        """
        kept = total = 0
        per_worker: Counter[int] = Counter()
        for n, (key, _) in enumerate(self.items, start=1):
            if self.outcome(key, version, k) == "admitted":
                worker, n_groups, n_kept = self.tallies[key]
                kept, total = kept + n_kept, total + n_groups
                per_worker[worker] += n_groups
                if step_ready(kept, total, per_worker[worker], batch_prompts,
                              self.scanner.rollout_workers):
                    return [(key, t, self.outcome(key, version, k)) for key, t in self.items[:n]]
        return None

    def whole(self, version: int, k: int) -> Batch | None:
        """Every buffered shard as one batch, when any of them can be admitted; None if none.

        A `--once` round starts after the stages that feed it have finished, so what the
        buffer holds is all the round will get: a step takes it even when filtering kept
        fewer than `batch_prompts` groups (none kept: the shards are committed as filtered
        and the round's version is the previous weights, see `Learner.step`), rather than
        waiting for groups that will not come.
        """
        batch = [(key, table, self.outcome(key, version, k)) for key, table in self.items]
        return batch if any(outcome == "admitted" for _, _, outcome in batch) else None

    def stale(self, version: int, k: int) -> Batch:
        """The buffered shards too old for `version`, as a batch of drops."""
        return [(key, table, "stale") for key, table in self.items
                if self.outcome(key, version, k) == "stale"]

    def remove(self, batch: Batch) -> None:
        gone = {key for key, _, _ in batch}
        self.items = [(key, table) for key, table in self.items if key not in gone]
        for key in gone:
            self.tallies.pop(key, None)

    def counts(self) -> Buffered:
        """Prompt groups (all, and kept by filtering) per rollout worker in the buffer: what
        rollout workers that cannot count kept groups themselves (score and prepare run as
        stages) read for their flow control."""
        groups, kept = Counter(), Counter()
        for w, n_groups, n_kept in self.tallies.values():
            groups[w] += n_groups
            kept[w] += n_kept
        return Buffered(groups_by_worker=dict(groups), kept_groups_by_worker=dict(kept))
