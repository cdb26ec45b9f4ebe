"""rollout: sample groups of G responses from the newest policy into rollout shards."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from itertools import chain

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config.stages import StandbyConfig
from ..engines.base import mixed_seed
from ..store import Store, StoreError
from ..store.keys import parse_shard_key
from ..store.records import Buffered, Progress, RetiredPrompts, Taken, WorkerState
from ..store.schemas import READY, ROLLOUT, TOKENS
from ..store.shards import ShardError, read_shard, write_shard
from ..tasks.source import make_task
from .channel import Channel
from .context import StageContext
from .engine import PolicyEngine
from .episodes import episode_metrics, episode_runner, policy_tokens, with_episode_columns
from .staleness import (
    backlog_cap,
    batch_shards,
    effective_k,
    group_cap,
    keep_rate,
    kept_backlog,
    lead_cap,
    standby_count,
    steps_ahead,
    worker_share,
)

MIN_ROUND_KEEP_RATE = 0.25
"""`--once` with score and prepare as stages: a round writes at most 1 / this times its share
of groups, however many the learner's filtering dropped so far."""
MAX_EMPTY_SHARDS = 20
"""Rollout shards in a row whose every prompt was too long before the stage gives up."""
LOST_CHECK_S = 5.0
"""Seconds of pausing between two looks for this worker's shards in quarantine."""
LOST_STAGES = ("score", "prepare", "learn")
"""The stages that read a worker's shards, so may quarantine them."""
REMEMBERED_SHARDS = 4096
"""Shards whose counts a worker remembers (the newest): one older than that the learner has
read long since, so it is no longer found in quarantine for the first time."""


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    rc = cfg.rollout
    task = make_task(cfg)
    base = ctx.preload_policy()  # while the snapshot evaluates v0, if it still runs
    ctx.wait_for_run()
    state_key = keys.worker_state(ctx.worker)
    saved = WorkerState.read(store, state_key)
    post = None
    if cfg.inline_postprocess:
        from .inline import InlinePostprocess

        post = InlinePostprocess(ctx)
        # its last shards may name a version newer than the store's (the weights channel's)
        post.recover(saved.version, max(ctx.latest_version() or 0, saved.version))
    # after `recover`, which finishes a rollout shard whose ready shard a crash cut short
    state = resumed_counts(ctx, saved, cfg.inline_postprocess)
    if state != saved:
        state.write(store, state_key)
    retired = (RetiredPrompts(store, keys) if cfg.algo.filters.no_positive_resampling.enabled
               else None)
    engine = PolicyEngine(ctx, ctx.wait_for_policy(rc.poll_interval_s), base)
    episodes = episode_runner(ctx, engine)  # None: single responses
    channel = Channel.from_env()  # new weights ahead of their commit (`stages.channel`)
    flow = Flow(ctx, state, exact=post is not None,  # its clock starts with the first policy
                channel=channel)
    paused, skipped = None, 0  # paused: monotonic time the current pause began
    pauses = PauseLog(ctx.log, flow)
    # store writes run in order on one thread, overlapping the next shard's generation; a
    # shard is written only after its sequence number's reservation is stored
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-store")
    writes: list[Future] = []  # the previous batch's shard writes, each checked before the next
    try:
        while not ctx.done():
            if ctx.once and flow.round_done():
                break
            progress = Progress.read(store, keys.progress())
            if not ctx.once and flow.full(progress):
                # a failed write must not leave the worker waiting on a backlog that counts
                # its lost shard
                writes = _settled(writes)
                if paused is None:
                    pauses.pausing(flow.why)
                    paused = time.monotonic()
                # as the pause begins, the counts with the last batch, stored now that its
                # shards are: the next reservation stores them only once the worker resumes,
                # and a worker stopped while it waits (most of its time when the learner sets
                # the pace) would resume without them and run ahead of its cap for good. The
                # version it may still write is the committed one at least: stages close the
                # versions below every worker's, and a worker paused long (a standby one)
                # would otherwise hold them open, each step listing more versions
                version = max(state.version, progress.version)
                if state.reserved_from is not None or (
                        version >= state.version + max(1, cfg.learner.max_staleness)):
                    counted = WorkerState(next_seq=state.next_seq, version=version,
                                          **flow.state())
                    _store_state([], counted, store, state_key)
                    state = counted
                flow.pause(rc.poll_interval_s)
                continue
            if paused is not None:  # woken by the learner's commit: how long after its capture
                ctx.metrics.log(progress.version,
                                {"resume_lag_s": time.time() - (progress.time or time.time()),
                                 "pause_s": time.monotonic() - paused})
            paused = None
            # progress.json is written after the weights it names and just before LATEST.json
            newest = max(ctx.latest_version() or 0, progress.version)
            if channel is None:
                engine.ensure(newest)
            elif not engine.take(channel, newest) and newest > engine.version:
                engine.ensure(newest)  # never back to the store's older version
            # several shards in one generation batch when the backlog has room for them
            first, n = state.next_seq, flow.batch(progress)
            # reserve the sequence numbers first: a crash leaves gaps, never two shards with one name
            state = WorkerState(next_seq=first + n, version=engine.version, reserved_from=first,
                                **flow.state())
            # the state's counts include the previous batch's shards: it is stored only once
            # they are (the writer runs in order, so they have finished by then)
            reserved = writer.submit(_store_state, list(writes), state, store, state_key)
            shards = []  # (seq, items) of the batch
            prompt_ids = []  # token ids of the batch's prompts, in order
            for seq in range(first, first + n):
                items, ids = _fitting(ctx, engine, _prompts(ctx, task, seq, retired), seq)
                if items:
                    shards.append((seq, items))
                    prompt_ids += ids
                    skipped = 0
                    continue
                skipped += 1
                if skipped >= MAX_EMPTY_SHARDS:  # a setting to change: no restart would help
                    from ..config import ConfigError, FieldError

                    raise ConfigError("the run's config", [FieldError(
                        "rollout.max_new_tokens",
                        f"{skipped} rollout shards in a row had only prompts that are empty "
                        f"or longer than the context ({engine.context} tokens with "
                        f"max_new_tokens {rc.max_new_tokens}; see quarantine/rollout/prompts/):"
                        " shorten the prompts, lower rollout.max_new_tokens or use a model "
                        "with a longer context")])
            if not shards:
                continue
            started, cpu_started = time.monotonic(), time.thread_time()
            with ctx.cores.busy():
                sampling = dict(temperature=rc.temperature, top_p=rc.top_p,
                                max_new_tokens=rc.max_new_tokens,
                                seed=mixed_seed(cfg.seed, ctx.worker, first))
                if episodes is None:
                    groups = engine.engine.generate(prompt_ids, rc.group_size, **sampling)
                else:
                    groups = episodes.run([it for _, items in shards for it in items],
                                          prompt_ids, rc.group_size, **sampling)
            seconds = time.monotonic() - started
            flow.sampled(time.thread_time() - cpu_started)
            writes = _settled(writes)  # the previous batch is stored (or its error surfaces)
            at = 0
            # for the shards' version lag (the engine's may be newer: the weights channel's)
            latest = max(ctx.latest_version() or 0, engine.version)
            for seq, items in shards:
                ids, grouped = prompt_ids[at:at + len(items)], groups[at:at + len(items)]
                at += len(items)
                table = _table(ctx, engine, items, ids, grouped, seq)
                key = keys.rollout(engine.version, ctx.worker, seq)
                if post is not None:
                    post_started = time.monotonic()
                    with ctx.cores.busy():
                        scored, ready = post.process(table)
                    ctx.metrics.log(engine.version, {"post_s": time.monotonic() - post_started})
                    prep_state = post.preparer.record(key, ready)
                    flow.wrote(seq, len(items), ready)
                    job = (_write_inline, reserved, post, key, table, scored, ready, prep_state)
                else:
                    flow.wrote(seq, len(items), None)
                    job = (_write_reserved, reserved, store, key, table)
                writes.append(writer.submit(*job))
                _log_metrics(ctx, engine.version, latest, table,
                             seconds * len(items) / len(prompt_ids), flow)
            flow.generated(time.monotonic() - started)
    finally:
        writer.shutdown()  # waits for the writes still queued
        if post is not None:
            post.flush()
        if channel is not None:
            ctx.log.info("versions from the weights channel: %d (the others from the store; "
                         "the channel %s)", engine.from_channel, channel.path)
    _settled(writes)
    return 0


def resumed_counts(ctx: StageContext, state: WorkerState, inline: bool) -> WorkerState:
    """`state` with the reserved shards the worker wrote before it stopped counted (their
    groups, and kept groups with `inline` post-processing): the counts that include a batch
    are stored only as the worker pauses or reserves its next batch, and a worker stopped in
    between would otherwise run ahead of its cap by that batch for good. A shard a stage has
    quarantined since counts too (the worker subtracts it when it finds it there), one that
    does not read as an average shard of this worker (as the worker subtracts it); one that
    retention has deleted since cannot be counted."""
    from .inline import kept_groups

    if state.reserved_from is None:
        return state
    keys, store = ctx.keys, ctx.store
    groups = kept = 0
    for seq in range(state.reserved_from, state.next_seq):
        key = keys.rollout(state.version, ctx.worker, seq)
        last = keys.ready_for(key) if inline else key  # a worker's last write of a shard
        found = [k for k in [last] + [keys.quarantine(s, last) for s in LOST_STAGES]
                 if store.exists(k)]
        if not found:
            continue  # never written
        try:
            table = read_shard(store, found[0], READY if inline else ROLLOUT)
        except ShardError:  # unreadable: counted as `Flow.check_lost` will take it away
            # when it finds the shard in quarantine, as an average shard of this worker
            n = ctx.cfg.rollout.prompts_per_shard
            groups += n
            kept += round(n * keep_rate(state.kept_written, state.groups_written)) if inline else n
            continue
        n = pc.count_distinct(table.column("group_id")).as_py()
        groups += n
        kept += kept_groups(table) if inline else n
    ctx.log.info("counting %d prompt groups (%d kept) of shards %d-%d written before the "
                 "worker stopped", groups, kept, state.reserved_from, state.next_seq - 1)
    return state.model_copy(update={"groups_written": state.groups_written + groups,
                                    "kept_written": state.kept_written + kept,
                                    "reserved_from": None})


def _settled(writes: list[Future]) -> list[Future]:
    """Wait for `writes`, raising the first one's error; the empty list of writes left."""
    for write in writes:
        write.result()
    return []


def _store_state(previous: list[Future], state: WorkerState, store: Store, key: str) -> None:
    """Store the worker's `state` (before a batch, its reservation; as it pauses, the counts
    that include its last batch) once every shard write it counts has succeeded; a failed
    one raises instead, so the saved counts never include a lost shard."""
    _settled(previous)
    state.write(store, key)


def _write_reserved(reserved: Future, store: Store, key: str, table: pa.Table) -> None:
    """Write a rollout shard once its reservation is stored; a failed reservation raises."""
    reserved.result()
    write_shard(store, key, table, ROLLOUT)


def _write_inline(reserved: Future, post, key: str, table: pa.Table, scored: pa.Table,
                  ready: pa.Table, prep_state: dict) -> None:
    """The shards of one reservation (the ready one; with `inline_shards: all` the rollout
    and scored ones before it), once the reservation is stored."""
    reserved.result()
    post.write(key, table, scored, ready, prep_state)


def backlog(progress: Progress, worker: int, groups_written: int, kept_written: int | None,
            buffered: Buffered | None = None) -> float:
    """Kept prompt groups `worker` wrote that the learner has not committed, from the
    learner's `progress.json` (whose size does not grow with the run).

    `kept_written` None: unknown (score and prepare run as stages). Then the learner's
    `buffered.json` says how many groups of the worker it has read and how many of those were
    kept; groups still on their way (scored, prepared, not yet read) count at the keep rate
    of everything the learner has seen of this worker (1 before it has seen any)."""
    groups_done = progress.groups_by_worker.get(worker, 0)
    kept_done = progress.kept_groups_by_worker.get(worker, 0)
    if kept_written is not None:
        return kept_backlog(kept_written, kept_done)
    buffered = buffered or Buffered()
    groups_buf = buffered.groups_by_worker.get(worker, 0)
    kept_buf = buffered.kept_groups_by_worker.get(worker, 0)
    rate = keep_rate(kept_done + kept_buf, groups_done + groups_buf)
    on_the_way = max(0, groups_written - groups_done - groups_buf)
    return kept_buf + on_the_way * rate


class Flow:
    """A worker's flow control, counted in prompt groups kept by filtering (the unit the
    learner consumes): pause while the kept groups this worker wrote and the learner has
    not committed reach `staleness.backlog_cap`, or, with `rollout.lead_counted_at: take`,
    while those it has not yet taken into a step fill `staleness.lead_cap`. With inline
    post-processing the worker knows each shard's kept groups; otherwise it estimates them
    with the keep rate of its groups the learner committed so far. Its shards that a stage
    quarantined no longer count (`check_lost`). A standby worker
    (`rollout.standby`) also pauses while `Standby` says the learner has data enough."""

    def __init__(self, ctx: StageContext, state: WorkerState, exact: bool,
                 channel: Channel | None = None) -> None:
        self.ctx, self.exact, self.channel = ctx, exact, channel
        rc, lc = ctx.cfg.rollout, ctx.cfg.learner
        standby = 0 if ctx.once else standby_count(rc.standby.workers, ctx.workers)
        self.standby = Standby(rc.standby) if ctx.worker >= ctx.workers - standby else None
        """The standby rule when this is a standby worker, else None."""
        self.share = worker_share(lc.batch_prompts, ctx.workers if self.standby or not standby
                                  else ctx.workers - standby)
        """Kept groups this worker contributes to a step: the batch split among the workers
        that generate throughout (each standby worker's: split among all)."""
        self.at_take = exact and not ctx.once and rc.lead_counted_at == "take"
        self.taken: Taken | None = None
        """The learner's last `Taken` record, read by `full` (and used by `batch` after it)."""
        self.why = ""
        """Why `full` last said to pause, for the log."""
        self.groups = state.groups_written
        self.kept = state.kept_written
        self.written: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """(groups, kept groups) of the last `REMEMBERED_SHARDS` shards this process wrote,
        by sequence number."""
        self.lost: dict[int, tuple[int, float]] = {}
        """(groups, kept groups) of this worker's shards a stage quarantined, by sequence
        number: the learner can never commit them (see `check_lost`)."""
        self.lost_checked: float | None = None
        """`paused_s` at the last look for them; None before the first."""
        self.arrivals = ctx.store.watch(ctx.keys.root + "state/learn/", depth=0)
        self.started = time.monotonic()
        self.paused_s = 0.0
        """Seconds spent waiting in `pause` (the backlog was full)."""
        self.generating_s = 0.0
        """Seconds inside generation batches: sampling, scoring and prepare, shard hand-off."""
        self.sampling_cpu_s = 0.0
        """CPU seconds of the sampling calls alone (the calling thread's: all of it with
        `rollout.threads` 1): what the worker spends on the model, apart from the protocol."""
        self.round_kept = 0
        self.round_groups = 0
        self.round_rate = 1.0
        """`--once` without kept counts: the share of this worker's groups the learner kept
        so far (at least MIN_ROUND_KEEP_RATE), so a round writes enough groups for its share
        of kept ones on average."""
        if ctx.once and not exact:
            progress = Progress.read(ctx.store, ctx.keys.progress())
            rate = keep_rate(progress.kept_groups_by_worker.get(ctx.worker, 0),
                             progress.groups_by_worker.get(ctx.worker, 0))
            self.round_rate = max(rate, MIN_ROUND_KEEP_RATE)

    def state(self) -> dict[str, int]:
        """The counts the worker's state records (those before the reserved shards)."""
        return {"groups_written": self.groups, "kept_written": self.kept}

    def wrote(self, seq: int, groups: int, ready: pa.Table | None) -> None:
        from .inline import kept_groups

        kept = kept_groups(ready) if ready is not None else groups
        self.written[seq] = (groups, kept)
        if len(self.written) > REMEMBERED_SHARDS:
            self.written.popitem(last=False)
        self.groups += groups
        self.kept += kept
        self.round_kept += kept
        self.round_groups += groups

    @property
    def live_groups(self) -> int:
        """Prompt groups written, less those in shards a stage quarantined."""
        return self.groups - sum(g for g, _ in self.lost.values())

    @property
    def live_kept(self) -> float:
        """Kept groups written, less those in shards a stage quarantined."""
        return self.kept - sum(k for _, k in self.lost.values())

    def check_lost(self) -> None:
        """Look for this worker's shards in quarantine: a stage that could not read one (a
        corrupt or foreign file) moved it there, so the learner never commits its groups,
        and counted as waiting they would shrink the worker's cap for good (a small cap to
        nothing: the run would stop). Their groups leave the backlog; a shard written
        before this process started (or long before) counts as its file says (`_count`)."""
        keys, prefix = self.ctx.keys, self.ctx.keys.quarantine_prefix()
        found = (k for stage in LOST_STAGES for k in self.ctx.store.list(f"{prefix}{stage}/"))
        for key in found:
            if not key.endswith(".parquet"):
                continue
            try:
                stage, original = keys.unquarantined(key)
                shard = parse_shard_key(original)
            except ValueError:
                continue
            if shard.worker != self.ctx.worker or shard.seq in self.lost:
                continue
            known = self.written.get(shard.seq) or self._count(key)
            self.lost[shard.seq] = known
            self.ctx.log.warning(
                "%s quarantined this worker's shard %s (see %s.error.json): its %d prompt "
                "groups (%.0f kept) will never be committed and no longer count as waiting",
                stage, original, key, known[0], known[1])

    def _count(self, key: str) -> tuple[int, float]:
        """(prompt groups, kept groups) of a quarantined shard this process did not write:
        read from its file where the file still reads as a table (a shard quarantined for
        its schema or values), else those of an average shard of this worker
        (`rollout.prompts_per_shard` groups at the keep rate of what the learner committed):
        an estimate, since a corrupt file tells nothing."""
        from .inline import kept_groups

        groups, kept = self.ctx.cfg.rollout.prompts_per_shard, None
        try:
            table = pq.read_table(pa.BufferReader(self.ctx.store.get_bytes(key)))
            groups = len(pc.unique(table.column("group_id")))
        except (pa.ArrowException, KeyError, StoreError):
            pass  # not a table, or no groups: an average shard
        else:
            with suppress(pa.ArrowException, KeyError):  # its groups known, perhaps not kept
                kept = kept_groups(table)
        if kept is None:
            kept = groups * keep_rate(self.kept, self.groups) if self.exact else groups
        return groups, kept

    def backlog(self, progress: Progress) -> float:
        if self.exact:
            return backlog(progress, self.ctx.worker, self.live_groups, self.live_kept)
        buffered = Buffered.read(self.ctx.store, self.ctx.keys.buffered())
        return backlog(progress, self.ctx.worker, self.live_groups, None, buffered)

    def ahead(self, progress: Progress) -> int:
        """The steps a worker may run ahead of the learner (`staleness.steps_ahead`)."""
        cfg = self.ctx.cfg
        lc = cfg.learner
        k = effective_k(lc.max_staleness, progress.version, lc.total_steps,
                        lc.halve_staleness_at)
        return steps_ahead(cfg.rollout.max_backlog_steps, k)

    def cap(self, progress: Progress) -> int:
        """Kept groups not yet committed at which the worker pauses."""
        return backlog_cap(self.share, self.ahead(progress))

    def from_take(self, progress: Progress) -> bool:
        """Whether the lead counts from the learner's take now (`lead_counted_at: take`,
        and at least one step ahead allowed)."""
        return self.at_take and self.ahead(progress) >= 1

    def room(self, progress: Progress) -> float:
        """Kept groups the worker may still write before it pauses: counted from the take
        (`lead_counted_at: take`, when it applies), else from the commit."""
        if self.from_take(progress):
            ahead = self.ahead(progress)
            worker = self.ctx.worker
            taken = self.taken.kept_groups_by_worker.get(worker, 0) if self.taken else 0
            done = max(taken, progress.kept_groups_by_worker.get(worker, 0))
            return lead_cap(self.share, ahead) - kept_backlog(self.live_kept, done)
        return self.cap(progress) - self.backlog(progress)

    def newest(self, progress: Progress) -> int:
        """The newest version this worker can load: committed, or in the weights channel."""
        fast = self.channel.latest() if self.channel is not None else None
        return max(progress.version, fast or 0)

    def waiting_groups(self, progress: Progress) -> int:
        """Prompt groups, kept or not, this worker wrote that the learner has not committed."""
        return max(0, self.live_groups - progress.groups_by_worker.get(self.ctx.worker, 0))

    def full(self, progress: Progress) -> bool:
        if self.at_take or self.standby is not None:
            self.taken = Taken.read(self.ctx.store, self.ctx.keys.taken(), optional=True)
        if self.standby is not None and not self.standby.called(self.taken, self.ctx.log):
            self.why = "standing by"
            return True
        if self.at_take and self.taken is not None and self.taken.version > self.newest(progress):
            # the version the learner took its batch at is on its way: generate with it, not
            # with the one before (two behind at the next take)
            self.why = f"waiting for version {self.taken.version}, which the learner took at"
            return True
        if (room := self.room(progress)) <= 0:
            take = self.from_take(progress)
            limit = lead_cap(self.share, self.ahead(progress)) if take else self.cap(progress)
            self.why = (f"{limit - room:.0f} kept groups not yet "
                        f"{'taken' if take else 'committed'} (cap {limit})")
            return True
        if (waiting := self.waiting_groups(progress)) >= group_cap(self.cap(progress)):
            self.why = f"{waiting} groups not yet committed"
            return True
        return False

    def pause(self, timeout: float) -> None:
        """Wait for the learner's next commit (or `timeout`); now and then (at the first
        pause, then every `LOST_CHECK_S` seconds of pausing) look for quarantined shards."""
        if self.lost_checked is None or self.paused_s - self.lost_checked >= LOST_CHECK_S:
            self.lost_checked = self.paused_s
            self.check_lost()
        started = time.monotonic()
        self.arrivals.wait(timeout)
        self.paused_s += time.monotonic() - started

    def sampled(self, cpu_seconds: float) -> None:
        """A sampling call took `cpu_seconds` of the worker's thread."""
        self.sampling_cpu_s += cpu_seconds

    def generated(self, seconds: float) -> None:
        """A generation batch took `seconds`, from sampling to its shards' hand-off."""
        self.generating_s += seconds

    @property
    def busy_s(self) -> float:
        """Seconds since the first policy arrived not spent paused on the backlog: generation
        batches and the work between them (loading new weights, drawing and encoding the
        next prompts, reserving shard numbers)."""
        return time.monotonic() - self.started - self.paused_s

    def busy_fraction(self) -> float:
        elapsed = time.monotonic() - self.started
        return (elapsed - self.paused_s) / max(elapsed, 1e-9)

    def kept_per_shard(self) -> float:
        """Expected kept groups of one shard: this worker's keep rate so far (exact counts
        inline), or the learner's count of its groups, times prompts per shard."""
        if self.exact:
            rate = keep_rate(self.kept, self.groups)
        else:
            rate = self.round_rate if self.ctx.once else 1.0
        return self.ctx.cfg.rollout.prompts_per_shard * rate

    def batch(self, progress: Progress) -> int:
        """Shards to generate in one batch: as many as the backlog has room for."""
        rc = self.ctx.cfg.rollout
        if self.ctx.once:
            share = worker_share(self.ctx.cfg.learner.batch_prompts, self.ctx.workers)
            room = share - (self.round_kept if self.exact
                            else self.round_groups * self.round_rate)
        else:
            return batch_shards(self.room(progress), self.kept_per_shard(), rc.max_batch_shards,
                                group_cap(self.cap(progress)) - self.waiting_groups(progress),
                                rc.prompts_per_shard)
        return batch_shards(room, self.kept_per_shard(), rc.max_batch_shards)

    def round_done(self) -> bool:
        """`--once`: this worker wrote its share of one step: kept groups when known, else
        groups that the keep rate so far expects to yield as many kept ones."""
        cfg = self.ctx.cfg
        share = worker_share(cfg.learner.batch_prompts, self.ctx.workers)
        if self.exact:
            return self.round_kept >= share
        return self.round_groups * self.round_rate >= share


class PauseLog:
    """A worker's pause lines: the first pause, then at most one line every `every` seconds
    with the pauses since the last line (a worker the learner sets the pace of pauses about
    once a step: a line each would bury the rest of its log)."""

    def __init__(self, log, flow: Flow, every: float = 60.0) -> None:
        self.log, self.flow, self.every = log, flow, every
        self.count = 0
        """Pauses since the last line."""
        self.at: tuple[float, float] | None = None
        """(monotonic time, the worker's paused seconds) at the last line."""

    def pausing(self, why: str) -> None:
        now = time.monotonic()
        self.count += 1
        if self.at is None:
            self.log.info("pausing: %s", why)
        elif now - self.at[0] >= self.every:
            span = now - self.at[0]
            self.log.info("pausing: %s (%d pauses in the last %.0f s, %.0f%% of it paused)",
                          why, self.count, span, 100 * (self.flow.paused_s - self.at[1]) / span)
        else:
            return
        self.count = 0
        self.at = (now, self.flow.paused_s)


class Standby:
    """When a standby worker generates (`rollout.standby`): for the learner's first batch
    (before its first `Taken` record), and then from when the learner waited for data
    `start` of its wall time over the last `window_steps` steps until that share falls
    under `stop`. The share is read off the learner's `Taken` records, one per step."""

    def __init__(self, cfg: StandbyConfig) -> None:
        self.cfg = cfg
        self.marks: deque[tuple[float, float]] = deque(maxlen=cfg.window_steps + 1)
        """(stepping_s, elapsed_s) of the learner's last records, oldest first."""
        self.on = False
        self.learner: str | None = None
        """The learner process the marks came from (`Taken.learner`)."""

    def waiting_share(self) -> float | None:
        """The learner's share of wall time between steps (waiting for data, reading it)
        over the marks; None before two."""
        if len(self.marks) < 2:
            return None
        (in0, at0), (in1, at1) = self.marks[0], self.marks[-1]
        return 1.0 - (in1 - in0) / (at1 - at0) if at1 > at0 else None

    def called(self, taken: Taken | None, log=None) -> bool:
        """Whether to generate now, given the learner's last record (None: none yet)."""
        if taken is None:
            return True
        mark = (taken.stepping_s, taken.elapsed_s)
        if taken.learner != self.learner or (self.marks and mark[1] < self.marks[-1][1]):
            self.marks.clear()  # a restarted learner: its clock started again
            self.learner = taken.learner
        if not self.marks or mark != self.marks[-1]:
            self.marks.append(mark)
        share = self.waiting_share()
        if share is None:
            return self.on
        on = share > (self.cfg.stop if self.on else self.cfg.start)
        if on != self.on and log is not None:
            log.info("%s: the learner waited for data %.0f%% of its last %d steps",
                     "generating" if on else "standing by", 100 * share, len(self.marks) - 1)
        self.on = on
        return on


def _fitting(ctx: StageContext, engine: PolicyEngine, items: list, seq: int,
             ) -> tuple[list, list[list[int]]]:
    """The items whose prompt has a token and leaves room for max_new_tokens in the model's
    context, and their prompts' token ids (encoded once, here); the others are recorded
    under quarantine/rollout/prompts/ with the reason. An empty prompt (a tokenizer that adds
    no BOS) would be sampled from padding alone, and the learner would refuse its rows."""
    budget, context = ctx.cfg.rollout.max_new_tokens, engine.context
    encoded = engine.encode([it.prompt for it in items])
    lengths = [len(ids) for ids in encoded]
    fits = [engine.fits(n, budget) for n in lengths]
    if all(fits):
        return items, encoded
    unfit = [{"prompt_id": it.prompt_id, "prompt_tokens": n}
             for it, n, ok in zip(items, lengths, fits, strict=True) if not ok]
    empty = sum(1 for p in unfit if p["prompt_tokens"] == 0)
    key = ctx.keys.quarantine("rollout", ctx.keys.root + f"prompts/w{ctx.worker:02d}-{seq:06d}.json")
    ctx.store.put_json(key, {
        "reason": "prompt_too_long" if not empty else "empty_prompt" if empty == len(unfit)
        else "empty_prompt_or_too_long", "context": context, "max_new_tokens": budget,
        "message": f"a prompt needs a token, and its tokens + max_new_tokens {budget} must fit "
                   f"the model's context of {context} tokens", "prompts": unfit,
        "time": time.time()})
    ctx.log.warning("%d prompt(s) skipped (%d empty, %d longer than the context): %s",
                    len(unfit), empty, len(unfit) - empty, key)
    return ([it for it, ok in zip(items, fits, strict=True) if ok],
            [ids for ids, ok in zip(encoded, fits, strict=True) if ok])


def _prompts(ctx: StageContext, task, seq: int, retired: RetiredPrompts | None):
    n = ctx.cfg.rollout.prompts_per_shard
    if retired is None:
        return task.train_items(ctx.worker, seq, n)
    skip = retired.refresh()
    fresh = [it for it in task.train_items(ctx.worker, seq, 4 * n) if it.prompt_id not in skip]
    return fresh[:n] or task.train_items(ctx.worker, seq, n)


def _table(ctx: StageContext, engine: PolicyEngine, items, prompt_ids: list[list[int]], groups,
           seq: int) -> pa.Table:
    samples = [s for group in groups for s in group]
    table = rollout_table(items, prompt_ids, groups, version=engine.version, worker=ctx.worker,
                          seq=seq, texts=engine.decode_all([s.token_ids for s in samples]),
                          created_at=time.time())
    if ctx.cfg.task.environment is None:
        return table
    return with_episode_columns(table, samples)


def rollout_table(items, prompt_ids: list[list[int]], groups, *, version: int, worker: int,
                  seq: int, texts: list[str], created_at: float) -> pa.Table:
    """A rollout shard's rows: sample j of group i (`groups[i][j]`, of prompt `items[i]`
    with token ids `prompt_ids[i]`) is a row, in that order; `texts` are the samples'
    decoded responses in the same order. Built a column at a time, a group's values once and
    repeated for its samples, the token lists from one flat array each: with the decoding
    (`PolicyEngine.decode_all`), 0.48-0.64 ms a demo shard against 0.69-0.74 row by row."""
    if not len(items) == len(prompt_ids) == len(groups):
        raise ValueError(f"{len(items)} items, {len(prompt_ids)} prompts and {len(groups)} "
                         "groups: one of each per prompt")
    sizes = [len(group) for group in groups]
    samples = [s for group in groups for s in group]
    rows = len(samples)
    if len(texts) != rows:
        raise ValueError(f"{len(texts)} response texts for {rows} samples")
    owner = pa.array(np.repeat(np.arange(len(items)), sizes))  # each row's group

    def per_group(values: list, type_: pa.DataType) -> pa.Array:
        return pa.array(values, type_).take(owner)

    lengths = np.fromiter((len(s.token_ids) for s in samples), np.int64, rows)
    if not np.array_equal(lengths, np.fromiter((len(s.logprobs) for s in samples), np.int64,
                                               rows)):
        raise ValueError("a sample's behaviour logprobs differ in number from its tokens")
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))), pa.int32())

    def ragged(lists, type_: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(list(chain.from_iterable(lists)), type_))

    columns = {
        "prompt_id": per_group([it.prompt_id for it in items], pa.string()),
        "group_id": per_group([f"w{worker:02d}-{seq:06d}-{i:03d}" for i in range(len(items))],
                              pa.string()),
        "sample_idx": pa.array(np.concatenate([np.arange(n) for n in sizes]
                                              + [np.zeros(0, np.int64)]), pa.int32()),
        "policy_version": pa.array(np.full(rows, version), pa.int64()),
        "worker": pa.array(np.full(rows, worker), pa.int32()),
        "prompt_text": per_group([it.prompt for it in items], pa.string()),
        "prompt_token_ids": per_group(prompt_ids, TOKENS),
        "response_token_ids": ragged((s.token_ids for s in samples), pa.int32()),
        "behavior_logprobs": ragged((s.logprobs for s in samples), pa.float32()),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "response_text": pa.array(texts, pa.string()),
        "answer": per_group([it.answer for it in items], pa.string()),
        "category": per_group([it.category for it in items], pa.string()),
        "created_at": pa.array(np.full(rows, created_at), pa.float64()),
    }
    # typed as the schema: no cast when the shard is encoded
    return pa.Table.from_arrays([columns[name] for name in ROLLOUT.names], schema=ROLLOUT)


def _log_metrics(ctx: StageContext, version: int, latest: int, table: pa.Table,
                 seconds: float, flow: Flow) -> None:
    """A shard's metrics; `latest` is the newest published version when it was generated.
    The response lengths are whole responses (an episode's replies included); the token
    rate counts the tokens the policy generated."""
    lengths = pc.list_value_length(table.column("response_token_ids")).to_numpy()  # (N,)
    truncated = pc.equal(table.column("finish_reason"), "length").to_numpy()     # (N,)
    p50, p90 = np.percentile(lengths, [50, 90])
    generated = policy_tokens(table)
    ctx.metrics.log(version, {
        "response_length_mean": float(lengths.mean()),
        "response_length_p50": float(p50),
        "response_length_p90": float(p90),
        "response_length_max": float(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "tokens_per_s": float(generated / max(seconds, 1e-9)),
        "generate_s": seconds,
        "version_lag": float(latest - version),
        "samples": float(len(lengths)),
        "busy_fraction": flow.busy_fraction(),
        "busy_s": flow.busy_s,
        "generating_s": flow.generating_s,
        "sampling_cpu_s": flow.sampling_cpu_s,
    } | episode_metrics(table))
