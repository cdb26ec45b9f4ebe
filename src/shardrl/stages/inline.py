"""Scoring and prepare inside a rollout worker (`rollout.postprocess: inline`).

When rewards come from cheap verifiers and no reference logprobs are needed, the score and
prepare stages would only add two processes and two store hops per shard. A worker then
runs the same `Scorer` and `Preparer` on each shard it generates and writes the ready shard
they would have written, under the same name: the learner, the accounting, quarantine and
every reader see what the stages would have made. The ready shard holds every column of the
rollout and scored shards, so by default (`rollout.inline_shards: ready`) it is the only
shard written, one store write per generated shard instead of three; with `all` the worker
also writes the rollout and scored shards first, in pipeline order. Metrics keep their
`score/` and `prepare/` names.

With `all`, a crash can leave a rollout shard whose ready shard was not written: the
restarted worker finishes those first (`recover`), before it reserves a new sequence
number, so the learner never closes a version that still owes a ready shard. With `ready`
a crash before the single write leaves a gap in the sequence numbers, as a crash of a
worker without post-processing does.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from ..store.keys import shard_name
from ..store.schemas import READY, ROLLOUT, SCORED
from ..store.shards import read_or_quarantine, write_shard
from .context import StageContext
from .prepare import STATE, Preparer
from .scan import output_names, read_cursor
from .score import Scorer


def kept_groups(ready: pa.Table) -> int:
    """Prompt groups of a ready shard with at least one row kept by filtering (the group
    ids of the kept rows alone: filtering the whole table copies every column)."""
    ids = pc.filter(ready.column("group_id"), ready.column("keep"))
    return len(pc.unique(ids)) if len(ids) else 0


class InlinePostprocess:
    """The score and prepare work of one rollout worker's shards."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.scorer = Scorer(ctx.as_stage("score"))
        state = STATE if ctx.workers == 1 else f"w{ctx.worker:02d}.json"
        self.preparer = Preparer(ctx.as_stage("prepare"), state)
        self.all_shards = ctx.cfg.rollout.inline_shards == "all"
        """Whether the rollout and scored shards are written too (else the ready one alone)."""

    def process(self, rollout: pa.Table) -> tuple[pa.Table, pa.Table]:
        """(scored, ready) tables of a rollout table."""
        scored = self.scorer.score(rollout)
        return scored, self.preparer.prepare(scored)

    def write(self, key: str, rollout: pa.Table | None, scored: pa.Table, ready: pa.Table,
              state: dict) -> None:
        """Write the shards in pipeline order (the rollout and scored ones only with
        `inline_shards: all`; `rollout` None: stored already), then the preparer state they
        advance, if it keeps any (the store writer thread runs this; `state` was captured
        when the shard was prepared)."""
        store, keys = self.ctx.store, self.ctx.keys
        if self.all_shards:
            if rollout is not None:
                write_shard(store, key, rollout, ROLLOUT)
            write_shard(store, keys.scored_for(key), scored, SCORED)
        write_shard(store, keys.ready_for(key), ready, READY)
        self.preparer.save(state)

    def recover(self, last_version: int, newest: int) -> None:
        """Finish this worker's rollout shards that have no ready shard yet (`all`: a crash
        between the writes; one the learner quarantined counts as finished), and merge preparer statistics of ready shards not yet recorded."""
        ctx, store, keys = self.ctx, self.ctx.store, self.ctx.keys
        low = min(read_cursor(store, keys, "learn"), last_version)
        mine = f"w{ctx.worker:02d}-"
        finished = output_names(store, keys, "ready")  # the learner's quarantine counts too
        for version in range(low, newest + 1):
            ready = finished(version)
            for key in store.list(keys.version_prefix("rollouts", version)):
                if not shard_name(key).startswith(mine) or shard_name(key) in ready:
                    continue
                table = read_or_quarantine(store, key, ROLLOUT, "score")
                if table is None:
                    ctx.log.warning("quarantined %s", key)
                    continue
                ctx.log.info("finishing %s (no ready shard yet)", key)
                scored, prepared = self.process(table)
                self.write(key, None, scored, prepared, self.preparer.record(key, prepared))
        self.preparer.recover(low, newest, only=mine)

    def flush(self) -> None:
        for ctx in (self.scorer.ctx, self.preparer.ctx):
            ctx.metrics.flush()
