"""Finding work without listing the whole run.

A stage that turns shards of kind `src` into shards of kind `dst` lists only the versions
that are still *open* for it. Version `v` closes for a stage once no more input can appear
there: upstream has closed `v` (for the first stage: every rollout worker has moved past
`v`) and every input of `v` has been handled. Each stage publishes the lowest open version
as its cursor (`state/<stage>/cursor.json`), so downstream stages and restarts start there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pyarrow as pa

from ..config import RunConfig
from ..graph import GENERATOR, consumer, stage, upstream
from ..store import RunKeys, Store
from ..store.keys import ShardKind, shard_name
from ..store.records import Cursor, WorkerState


def rollout_workers_past(store: Store, keys: RunKeys, workers: int) -> int:
    """The lowest version any rollout worker may still write (min over workers)."""
    return min(WorkerState.read(store, keys.worker_state(w)).version for w in range(workers))


def read_cursor(store: Store, keys: RunKeys, stage: str) -> int:
    return Cursor.read(store, keys.cursor(stage)).low


class Scanner:
    """Lists the open versions of the shard kind stage `name` reads and returns the keys
    `handled` does not cover. Its upstream (whose cursor closes versions) comes from the
    stage graph."""

    def __init__(self, store: Store, keys: RunKeys, cfg: RunConfig, name: str,
                 handled: Callable[[int], set[str]],
                 persist: Callable[[Callable[[], None]], None] | None = None) -> None:
        self.store, self.keys, self.stage = store, keys, name
        self.persist = persist or (lambda write: write())
        """Runs the cursor's write: at once, or (the learner) queued behind its commits."""
        self.src: ShardKind = stage(name).reads
        self.rollout_workers = stage(GENERATOR).replicas(cfg)
        self.upstream = upstream(name, cfg)
        self.handled = handled
        """version -> shard names already handled by this stage (outputs, ledger)."""
        self.low = read_cursor(store, keys, name)

    def upstream_low(self) -> int:
        if self.upstream is None:
            return rollout_workers_past(self.store, self.keys, self.rollout_workers)
        return read_cursor(self.store, self.keys, self.upstream)

    def poll(self, newest: int) -> list[str]:
        """Unhandled input keys of the open versions up to `newest`, oldest version first."""
        closed_below = self.upstream_low()
        todo: list[str] = []
        low = self.low
        for version in range(self.low, newest + 1):
            inputs = self.store.list(self.keys.version_prefix(self.src, version))
            done = self.handled(version)
            pending = [k for k in inputs if shard_name(k) not in done]
            todo.extend(pending)
            if version == low and version < closed_below and not pending:
                low = version + 1
        if low != self.low:
            self.low = low
            self.persist(partial(Cursor(low=low).write, self.store, self.keys.cursor(self.stage)))
        return todo


def output_names(store: Store, keys: RunKeys, kind: ShardKind) -> Callable[[int], set[str]]:
    """`handled` for a stage whose output for an input is a shard of `kind` with the same name.

    An output its consumer quarantined counts as handled: writing it again would let the
    same samples be both quarantined and consumed.
    """
    def handled(version: int) -> set[str]:
        prefix = keys.version_prefix(kind, version)
        reader = consumer(kind)
        quarantined = keys.quarantine(reader.name, prefix) if reader is not None else None
        names = {shard_name(k) for k in store.list(prefix)}
        if quarantined is not None:
            names |= {shard_name(k) for k in store.list(quarantined) if k.endswith(".parquet")}
        return names

    return handled


def process_shards(ctx, scanner: Scanner, schema: pa.Schema,
                   handle: Callable[[str, pa.Table], None], poll_interval_s: float) -> int:
    """The loop of a shard-to-shard stage: read each new input (quarantining what cannot be
    read), `handle(key, table)` it, and stop once DONE.json exists (or after one round with
    `--once`)."""
    from ..store.shards import read_or_quarantine

    arrivals = ctx.store.watch(ctx.keys.kind_prefix(scanner.src))
    while True:
        finished = ctx.done()
        newest = ctx.latest_version()
        todo = scanner.poll(newest) if newest is not None else []
        for key in todo:
            table = read_or_quarantine(ctx.store, key, schema, scanner.stage)
            if table is None:
                ctx.log.warning("quarantined %s", key)
                continue
            handle(key, table)
        if finished or (ctx.once and not todo):
            return 0
        if todo:
            arrivals.reset()
        else:
            arrivals.wait(poll_interval_s)
