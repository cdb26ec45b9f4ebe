"""learn: admit ready shards within staleness k, update the policy, publish versions.

Each optimizer step publishes policy version `step`. The commit order per step is: weights of
the new version, the ledger delta (which shards this commit consumed or dropped), an
optimizer checkpoint when due, `state/learn/progress.json` (the learner's resumable state and
the commit point), then `policy/LATEST.json`. A restarted learner resumes from progress.json:
versions stay continuous and no shard is consumed twice.

The step's store writes run in that order on a background thread while the next batch is
read and computed; at most one commit is in flight, and the learner waits for it before the
next commit, before DONE.json and before it exits. The weights and optimizer state are
serialized before the next update changes them. A crash can lose only the commit in flight,
which a restart redoes from the previous progress.json, as before.

Under `torchrun` (DeepSpeed with `learner.backend.ranks > 1`) rank 0 is the leader: it alone
lists, admits, logs and writes to the store. Before each update it broadcasts the step's plan
(the shards that make the batch, the version, the KL coefficient); the other ranks read those
shards, compute the same loss and join every collective of the step (the update, gathering
ZeRO-3 weights for publishing, the optimizer checkpoint) in the same order. An empty plan
tells them the run is over.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..algo import get_kl_controller, lr_schedule
from ..learner_backends import build_backend
from ..models.io import state_dict_bytes
from ..store import parse_shard_key
from ..store.schemas import READY
from ..store.shards import read_or_quarantine, read_shard
from .checkpoint import latest_checkpoint, save_checkpoint
from .context import StageContext
from .inline import kept_groups
from .policy import fetch_weights, load_policy, point_latest, publish_weight_bytes
from .progress import progress_key, read_progress
from .retention import Retention
from .scan import Scanner, shard_name
from .staleness import admitted, effective_k
from .update import compute_loss

BACKEND_STATE, CRITIC = "backend", "critic"
BUFFERED = "buffered.json"
"""Checkpoint files `<name>.safetensors`: the backend's optimizer state, the critic's weights."""


FILTERED_LIMIT = 8
"""Step anyway once this many batches' worth of groups wait and too few have signal."""


def main(ctx: StageContext) -> int:
    learner = Learner(ctx)
    return learner.run() if learner.leader else learner.follow()


class Learner:
    def __init__(self, ctx: StageContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        cfg, store, keys = ctx.cfg, ctx.store, ctx.keys
        published = store.watch(keys.root + "policy/", depth=0)
        while ctx.latest_version() is None:
            published.wait(cfg.learner.poll_interval_s)
        published.close()
        self.model, tok = load_policy(store, keys, 0, ctx.cache_dir())
        self.model.train()
        self.pad_id = tok.pad_token_id
        critic = None
        if cfg.algo.critic is not None:
            from ..models.heads import Critic
            from .policy import load_reference

            ref, _ = load_reference(store, keys, ctx.cache_dir())
            critic = Critic.from_causal_lm(ref)
        controller = cfg.algo.kl.controller
        self.kl = get_kl_controller(controller.kind)(**controller.model_dump(exclude={"kind"}))
        state = read_progress(store, keys)
        self.version = int(state.get("version", 0))
        self.commits = int(state.get("commits", 0))
        self.counts = Counter(state.get("counts", {}))
        self.by_worker = Counter({int(k): v for k, v in state.get("processed_by_worker", {}).items()})
        self.groups_by_worker = Counter(
            {int(k): v for k, v in state.get("groups_by_worker", {}).items()})
        self.kept_by_worker = Counter(
            {int(k): v for k, v in state.get("kept_groups_by_worker", {}).items()})
        self.staleness = Counter({int(k): v for k, v in state.get("staleness", {}).items()})
        self.ledger: dict[int, list[str]] = {int(k): v for k, v in state.get("ledger", {}).items()}
        if "kl" in state:
            self.kl.load_state_dict(state["kl"])
        ckpt = None
        if self.version > 0:  # weights go in before the backend takes the modules over
            self.model.load_state_dict(fetch_weights(store, keys, self.version), strict=False)
            ckpt = latest_checkpoint(store, keys)
            if ckpt is not None and critic is not None:
                data = store.get_bytes(keys.learner_file(ckpt, f"{CRITIC}.safetensors"))
                critic.load_state_dict(st_load(data))
        self.backend = build_backend(cfg.learner, self.model, critic=critic,
                                     critic_lr=cfg.algo.critic.lr if critic is not None else None)
        self.leader = self.backend.rank == 0
        self.in_step = False
        """True while the ranks are inside one step's collectives (see `run`)."""
        if self.version > 0:
            if ckpt is not None:  # every rank loads its partition (a collective call)
                data = store.get_bytes(keys.learner_file(ckpt, f"{BACKEND_STATE}.safetensors"))
                self.backend.load_state_dict(st_load(data))
            ctx.log.info("resumed at version %d (optimizer state from step %s)", self.version, ckpt)
            if self.leader:
                point_latest(store, keys, self.version, {"step": self.version})
        if self.backend.world_size > 1:
            ctx.log.info("rank %d of %d%s", self.backend.rank, self.backend.world_size,
                         " (leader)" if self.leader else "")
        # with inline post-processing the rollout workers close versions themselves
        self.scanner = Scanner(store, keys, cfg, "learn", lambda v: set(self.ledger.get(v, ())))
        self.arrivals = store.watch(keys.kind_prefix("ready"))
        self.retention = Retention(store, keys, cfg, self.version) if self.leader else None
        self.hops: list[float] = []
        """Hand-off latency since the last step: for each shard read while the learner was
        waiting for data, seconds from its generation to its reading (scoring, prepare and
        the store writes included; queueing behind a busy learner is not)."""
        self.waiting = False
        self.read_s = self.wait_s = 0.0
        """Seconds reading shards and waiting for data since the last step (its profile)."""
        self.buffer: list[tuple[str, pa.Table]] = []
        """(key, table) of read shards not yet committed, oldest version first."""
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learn-commit")
        self.pending: Future | None = None
        """The store writes in flight (one commit)."""
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        """CPU seconds of updates (this thread): busy time without waits for a shared core."""
        self.started = time.monotonic()
        from ..doctor.live import LiveDoctor

        self.doctor = LiveDoctor(cfg, store, keys)

    # -- admission --------------------------------------------------------------------------
    def k(self) -> int:
        lc = self.cfg.learner
        return effective_k(lc.max_staleness, self.version, lc.total_steps, lc.halve_staleness_at)

    def admit(self, key: str) -> None:
        started = time.monotonic()
        table = read_or_quarantine(self.ctx.store, key, READY, "learn")
        self.read_s += time.monotonic() - started
        if table is None:
            self.ctx.log.warning("quarantined %s", key)
            return
        if self.waiting:
            self.hops.append(time.time() - pc.max(table.column("created_at")).as_py())
        self.buffer.append((key, table))

    def outcome(self, key: str) -> str:
        """"stale" if the shard's policy version lags the learner's by more than k, at this step."""
        return ("admitted" if admitted(self.version, parse_shard_key(key).version, self.k())
                else "stale")

    def next_batch(self) -> int | None:
        """How many buffered shards (from the front) make the next step, None if too few.

        A step takes shards in order until B prompt groups kept by filtering are in (ScaleRL's
        effective batch), or a long run of filtered ones; stale shards on the way are dropped
        with it. Shards past that point wait for the next step, so a backlog (after a restart,
        say) makes several steps of size B rather than one huge one.
        """
        b = self.cfg.learner.batch_prompts
        kept, total = set(), set()
        for n, (key, table) in enumerate(self.buffer, start=1):
            if self.outcome(key) == "admitted":
                ids = table.column("group_id").to_pylist()
                total.update(ids)
                kept.update(g for g, k in zip(ids, table.column("keep").to_pylist(), strict=True)
                            if k)
                if len(kept) >= b or len(total) >= FILTERED_LIMIT * b:
                    return n
        return None

    def stale(self) -> list[tuple[str, pa.Table, str]]:
        """The buffered shards too old for the current version, as a batch of drops."""
        return [(key, table, "stale") for key, table in self.buffer
                if self.outcome(key) == "stale"]

    def buffered_counts(self) -> dict[str, dict[str, int]]:
        """Prompt groups (all, and kept by filtering) per rollout worker in shards read but
        not yet committed: `buffered.json`, which rollout workers that cannot count kept
        groups themselves (score and prepare run as stages) read for their flow control."""
        groups, kept = Counter(), Counter()
        for key, table in self.buffer:
            w = str(parse_shard_key(key).worker)
            groups[w] += len(pc.unique(table.column("group_id")))
            kept[w] += kept_groups(table)
        return {"groups_by_worker": dict(groups), "kept_groups_by_worker": dict(kept)}

    def publish_buffered(self) -> None:
        self._submit(self.ctx.store.put_json, self.ctx.keys.state("learn", BUFFERED),
                     self.buffered_counts())

    def _submit(self, write: Callable, *args) -> None:
        """Queue store writes behind the ones in flight, which must end first (order kept)."""
        self._wait()
        self.pending = self.writer.submit(write, *args)

    def _wait(self) -> None:
        """Wait for the writes in flight; their error, if any, is raised here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """The leader's loop; the other ranks `follow`."""
        try:
            return self._lead()
        finally:
            try:
                self._wait()
            finally:
                self.writer.shutdown(wait=True)
            # stop the followers, unless they are inside a collective this rank left by an
            # error: then this rank's exit ends the whole torchrun world
            if self.backend.world_size > 1 and not self.in_step:
                self.backend.broadcast_json(None)

    def follow(self) -> int:
        """A non-leader rank: run each step the leader broadcasts, until the empty plan."""
        while (plan := self.backend.broadcast_json(None)) is not None:
            tables = [read_shard(self.ctx.store, key, READY) for key in plan["shards"]]
            table = pa.concat_tables(tables)
            self.version = int(plan["version"])
            applied, _ = self.update(table.filter(table.column("keep")), float(plan["beta"]))
            self.sync(applied)
        return 0

    def _lead(self) -> int:
        ctx, lc = self.ctx, self.cfg.learner
        while self.version < lc.total_steps:
            buffered = {k for k, _ in self.buffer}
            new = [k for k in self.scanner.poll(self.version) if k not in buffered]
            for key in new:
                self.admit(key)
            if new:
                self.arrivals.reset()
            self.waiting = False
            if (n := self.next_batch()) is not None:
                self.step(n)
                if ctx.once and self.version < lc.total_steps:
                    return 0
            elif stale := self.stale():
                # dropped now, counted in the ledger: they can never be admitted, and waiting
                # for a step to carry them would hold their workers' backlog full
                self.commit(stale, stepped=False)
            elif new:
                if not self.cfg.inline_postprocess:
                    self.publish_buffered()
            else:
                if ctx.once and ctx.done():
                    return 0
                waited = time.monotonic()
                self.arrivals.wait(lc.poll_interval_s)
                self.wait_s += time.monotonic() - waited
                self.waiting = True
        self._wait()
        ctx.store.put_json(ctx.keys.done(), {
            "steps": self.version, "counts": dict(self.counts), "time": time.time(),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        })
        ctx.log.info("done: %d steps, %s", self.version, dict(self.counts))
        return 0

    def step(self, n: int) -> None:
        """One update on the first `n` buffered shards, then their commit."""
        lc = self.cfg.learner
        started, cpu_started = time.monotonic(), time.thread_time()
        batch = [(key, table, self.outcome(key)) for key, table in self.buffer[:n]]
        table = pa.concat_tables([t for _, t, outcome in batch if outcome == "admitted"])
        kept = table.filter(table.column("keep"))
        lag = self.version - pc.min(table.column("policy_version")).as_py()
        self.in_step = True
        if self.backend.world_size > 1:
            self.backend.broadcast_json({
                "version": self.version, "beta": self.kl.beta,
                "shards": [key for key, _, outcome in batch if outcome == "admitted"],
            })
        applied, metrics = self.update(kept, self.kl.beta)
        if applied and "kl_sum" in metrics:
            self.kl.update(metrics["kl_sum"], len(kept))
        if not applied:
            self.counts["skipped_steps"] += int(len(kept) > 0)
        for v in table.column("policy_version").to_pylist():
            self.staleness[self.version - v] += 1
        updated = time.monotonic()
        self.busy_s += updated - started
        self.busy_cpu_s += time.thread_time() - cpu_started
        self.commit(batch, stepped=applied)
        self.in_step = False
        committed = time.monotonic()
        wall = committed - self.started
        tokens = sum(len(r) for r in kept.column("response_token_ids").to_pylist())
        metrics.update(
            beta=self.kl.beta, staleness_max=float(lag), k=float(self.k()),
            samples=float(len(kept)), tokens=float(tokens),
            samples_per_s=len(kept) / max(committed - started, 1e-9),
            tokens_per_s=tokens / max(committed - started, 1e-9),
            update_s=updated - started, commit_s=committed - updated,
            busy_fraction=self.busy_s / max(wall, 1e-9),
            busy_cpu_fraction=self.busy_cpu_s / max(wall, 1e-9),
            busy_s=self.busy_s, busy_cpu_s=self.busy_cpu_s,
            stale_dropped=float(self.counts["stale_dropped"]),
            **self._hop_metrics(), read_s=self.read_s, wait_s=self.wait_s,
            skipped_steps=float(self.counts["skipped_steps"]),
        )
        self.read_s = self.wait_s = 0.0
        self.ctx.metrics.log(self.version, metrics)
        if applied and self.version % lc.doctor_every == 0:
            self.ctx.metrics.flush()  # the doctor reads the store: include this step
            self.doctor.check(self.version)

    def _hop_metrics(self) -> dict[str, float]:
        """Hand-off latency of the shards read since the last step (generation to reading)."""
        hops, self.hops = self.hops, []
        if not hops:
            return {}
        hops.sort()
        return {"hop_s": hops[len(hops) // 2], "hop_max_s": hops[-1]}

    def update(self, kept: pa.Table, beta: float) -> tuple[bool, dict[str, float]]:
        """One optimizer step on the kept rows at the current version (every rank).

        (applied, metrics); nothing happens, on every rank alike, when no row is kept.
        """
        lc = self.cfg.learner
        if not len(kept):
            return False, {}
        scale = lr_schedule(self.version, warmup_steps=lc.warmup_steps,
                            total_steps=lc.total_steps, kind=lc.schedule, min_ratio=lc.min_lr_ratio)
        self.backend.set_lr("policy", lc.lr * scale)
        with self.ctx.cores.busy() as cores:
            loss, m, _ = compute_loss(self.cfg, self.backend.policy, kept, self.pad_id, beta,
                                      self.backend.critic)
            cores.adjust()  # the backward pass may get cores the generator left meanwhile
            applied, grad_norm = self.backend.step(loss)
        metrics = {k: float(v) for k, v in m.items()}
        metrics.update(grad_norm=grad_norm, lr=lc.lr * scale)
        return applied, metrics

    def sync(self, stepped: bool) -> tuple[bytes | None, dict[str, bytes]]:
        """The collective part of a commit, on every rank in the same order.

        With an applied step the version advances and the full weights are gathered and
        serialized. When a checkpoint is due, the backend's full optimizer state (and the
        critic's weights) are gathered too, as checkpoint files. Returns (weights, checkpoint
        files) for the leader to write; (None, {}) on the other ranks or without a step.
        """
        weights, files = None, {}
        if not stepped:
            return weights, files
        self.version += 1
        with self.backend.gathered():
            if self.leader:
                weights = state_dict_bytes(self.model)
        if self.version % self.cfg.learner.ckpt_every == 0:
            state = self.backend.state_dict()
            if self.backend.critic is not None:
                with self.backend.gathered():
                    critic = state_dict_bytes(self.backend.critic.critic) if self.leader else b""
                files[CRITIC] = critic
            files[BACKEND_STATE] = st_save(state) if self.leader else b""
        return (weights, files) if self.leader else (None, {})

    def commit(self, batch: list[tuple[str, pa.Table, str]], stepped: bool) -> None:
        """Publish (if the step was applied) and record the batch's shards in the ledger.

        The state is captured now; the writes, in the commit order, go to the background
        writer (see the module docstring).
        """
        store, keys = self.ctx.store, self.ctx.keys
        weights, files = self.sync(stepped)
        version = self.version
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
            self.groups_by_worker[sk.worker] += len(pc.unique(table.column("group_id")))
            self.kept_by_worker[sk.worker] += kept_groups(table)
            self.ledger.setdefault(sk.version, []).append(shard_name(key))
            delta.append({"key": key, "outcome": outcome, "rows": rows})
        committed = {key for key, _, _ in batch}
        self.buffer = [(key, table) for key, table in self.buffer if key not in committed]
        buffered = None if self.cfg.inline_postprocess else self.buffered_counts()
        self.ledger = {v: names for v, names in self.ledger.items() if v >= self.scanner.low}
        self.commits += 1
        ledger_key = keys.state("learn", f"ledger-{self.commits:06d}.json")
        progress = {
            "version": version, "commits": self.commits, "counts": dict(self.counts),
            "processed_by_worker": {str(k): v for k, v in self.by_worker.items()},
            "groups_by_worker": {str(k): v for k, v in self.groups_by_worker.items()},
            "kept_groups_by_worker": {str(k): v for k, v in self.kept_by_worker.items()},
            "staleness": {str(k): v for k, v in self.staleness.items()},
            "ledger": {str(k): v for k, v in self.ledger.items()},
            "kl": self.kl.state_dict(), "beta": self.kl.beta, "time": time.time(),
        }

        def write() -> None:
            if weights is not None:
                publish_weight_bytes(store, keys, version, weights)
            store.put_json(ledger_key, {"version": version, "stepped": stepped, "shards": delta})
            if buffered is not None:  # before progress.json: a reader double-counts, never misses
                store.put_json(keys.state("learn", BUFFERED), buffered)
            if files:
                save_checkpoint(store, keys, version, files, self.cfg.learner.keep_checkpoints)
            store.put_json(progress_key(keys), progress)
            if stepped:
                point_latest(store, keys, version, {"step": version})
                self.retention.collect(version)

        self._submit(write)

