"""The learner: resume, the leader's loop, one step, one commit (see the package docstring)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
import torch
from safetensors.torch import load as st_load

from ...algo import get_kl_controller, lr_schedule
from ...learner_backends import build_backend
from ...learner_backends.base import MASTER, POLICY
from ...models.delta import publish_state, state_bytes
from ...models.dropout import disable_dropout
from ...models.io import StoredSafetensors
from ...store.records import Aborted, Done, LearnerRestart, Progress, Taken
from ...store.schemas import READY
from ...store.shards import read_shard
from .. import EXIT_RUN_ABORTED
from ..channel import Channel
from ..checkpoint import committed_checkpoint, latest_checkpoint, repair
from ..context import StageContext
from ..episodes import policy_tokens
from ..policy import fetch_weights, point_latest, publish_dtype
from ..retention import Retention
from ..scan import Scanner
from ..staleness import effective_k, standby_count
from ..update import checkpoint_activations, update_loss
from . import ranks
from .buffer import COLUMNS, Batch, ReadyBuffer
from .commit import Commit, Ledger, Writer
from .offload import Check, CommitProcess, Writes, commit_writes, settle
from .profile import Profile


class RunFinished(Exception):
    """The run's DONE.json exists already: a learner starting now has nothing to do."""


class Learner:
    def __init__(self, ctx: StageContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        # forked first, before the model loads or a thread starts (see `offload`), and
        # before the run exists, so that the fork is not on the way to the first step; the
        # leader's writes go where `learner.commit_writer` says, the other ranks' to a thread
        where = ctx.cfg.learner.commit_writer if os.environ.get("RANK", "0") == "0" else "thread"
        self.commits: Writes | CommitProcess = commit_writes(ctx.store, ctx.keys, where,
                                                             ctx.cfg)
        """What runs the commits' writes and the live doctor's checks."""
        try:
            self._start()
        except BaseException:
            self.commits.close()
            raise

    def _start(self) -> None:
        ctx, cfg, store, keys = self.ctx, self.cfg, self.ctx.store, self.ctx.keys
        base = ctx.preload_policy()  # while the snapshot evaluates v0, if it still runs
        ctx.wait_for_run()
        if store.exists(keys.done()):
            raise RunFinished
        ctx.wait_for_policy(cfg.learner.poll_interval_s)
        self.model, tok = base.take()
        if (lora := cfg.learner.lora) is not None:  # adapters on the frozen v0 weights
            from ...config import ConfigError, FieldError
            from ...models.lora import add_lora

            try:
                self.model = add_lora(self.model, lora.r, lora.alpha, lora.dropout,
                                      lora.target_modules, seed=cfg.seed)
            except ValueError as exc:  # peft: no module of the model is a target
                raise ConfigError("the run's config", [FieldError(
                    "learner.lora.target_modules", " ".join(str(exc).split()))]) from exc
        if off := disable_dropout(self.model):  # as the engines sample (see `models.dropout`)
            ctx.log.info("dropout off in %d module(s) of the policy while it trains", off)
        checkpoint_activations(cfg, self.model)
        self.model.train()
        self.pad_id = tok.pad_token_id
        state = Progress.read(store, keys.progress())
        self.version = state.version
        self.ledger = Ledger(state)
        controller = cfg.algo.kl.controller
        self.kl = get_kl_controller(controller.kind)(**controller.model_dump(exclude={"kind"}))
        if state.kl:
            self.kl.load_state_dict(state.kl)
        self.restart: LearnerRestart | None = None
        """How this process resumed, recorded with its first commit (replay repeats it)."""
        self.threads: list[int] = []
        """Torch threads of the last update's forward and backward (see `LedgerDelta`)."""
        self.dtype = publish_dtype(cfg)
        """Dtype of the published versions."""
        self.backend = self._resume_backend()
        self.leader = self.backend.rank == 0
        self.in_step = False
        """True while the ranks are inside one step's collectives (see `run`)."""
        self.profile = Profile()
        self.barren = Barren.resumed(state.no_signal)
        self.writer = Writer()
        rc = cfg.rollout
        self.takes_read = not ctx.once and (
            (rc.lead_counted_at == "take" and cfg.inline_postprocess)
            or standby_count(rc.standby.workers, rc.workers) > 0)
        """Whether a rollout worker reads the learner's takes (`took`)."""
        self.taken_writer = Writer()
        """The `Taken` records' own thread: a record waits behind the last one, not behind
        the last commit's writes."""
        self.start_id = f"{os.getpid()}-{time.time_ns()}"
        """This learner process's start, in its `Taken` records."""
        # the cursor is written after the commits queued before it: it never closes a
        # version whose last shards' ledger entry is not yet in the store
        scanner = Scanner(store, keys, cfg, "learn", self.ledger.handled, self.writer.later)
        self.buffer = ReadyBuffer(ctx, scanner, self.profile)
        self.retention = Retention(store, keys, cfg, self.version) if self.leader else None
        self.channel = Channel.from_env() if self.leader and not ctx.once else None
        """Where new weights go ahead of their commit (`stages.channel`), or None."""
        if self.channel is not None:
            self.channel.clear()  # versions an earlier learner made and may not have committed
        if ctx.metrics is not None and self.leader:  # a step's figures land behind its commit
            ctx.metrics.defer = self.writer.later

    def _resume_backend(self):
        """The backend over the policy (and critic), with the weights and optimizer state of
        the last commit and checkpoint when resuming."""
        ctx, cfg, store, keys = self.ctx, self.cfg, self.ctx.store, self.ctx.keys
        critic, ckpt = None, None
        if cfg.algo.critic is not None:
            from ...models.heads import Critic
            from ..policy import load_reference

            critic = Critic.from_causal_lm(load_reference(store, keys, ctx.cache_dir())[0])
            disable_dropout(critic)
        if self.version > 0:  # weights go in before the backend takes the modules over
            published = fetch_weights(store, keys, self.version)
            latest = latest_checkpoint(store, keys)
            ckpt = committed_checkpoint(store, keys, self.version, latest)
            if ckpt != latest:
                ctx.log.warning("checkpoint %s is past the committed version %d (the learner "
                                "stopped before committing it): optimizer state from step %s",
                                latest, self.version, ckpt)
            masters = keys.learner_file(ckpt or 0, f"{ranks.MASTERS}.safetensors")
            if cfg.learner.lora is not None:  # the base stays v0; the adapters are in the
                ckpt = self.version              # checkpoint of the committed version
            elif ckpt == self.version and store.exists(masters):  # narrower publish dtype
                self.model.load_state_dict(st_load(store.get_bytes(masters)), strict=False)
            else:
                self.model.load_state_dict(published, strict=False)
            if ckpt is not None and critic is not None:
                data = store.get_bytes(keys.learner_file(ckpt, f"{ranks.CRITIC}.safetensors"))
                critic.load_state_dict(st_load(data))
        if self.version == 0:
            published = publish_state(self.model, self.dtype)
        self.commits = settle(self.commits, cfg.learner.commit_writer, state_bytes(published))
        self.commits.base(self.version, published)  # what the next version's delta is against
        backend = build_backend(cfg.learner, self.model, critic=critic,
                                critic_lr=cfg.algo.critic.lr if critic is not None else None)
        if self.version > 0:
            if ckpt is not None:  # every rank loads its partition (a collective call),
                # reading the file a tensor at a time: never all of it in any rank's memory
                key = keys.learner_file(ckpt, f"{ranks.BACKEND_STATE}.safetensors")
                state = StoredSafetensors(partial(store.get_range, key), key)
                backend.load_state_dict(resumable_state(state, ckpt, self.version))
            ctx.log.info("resumed at version %d (optimizer state%s from step %s)", self.version,
                         " and the critic" if critic is not None else "", ckpt)
            if critic is not None and ckpt != self.version:  # the policy is the committed one
                ctx.log.warning("the critic resumes from %s, older than the policy's version "
                                "%d: checkpoint at every step (learner.ckpt_every: 1) for a "
                                "critic that resumes where it stopped",
                                f"the checkpoint of step {ckpt}" if ckpt is not None
                                else "its start (no checkpoint yet)", self.version)
            self.restart = LearnerRestart(checkpoint=ckpt)
            if backend.rank == 0:
                point_latest(store, keys, self.version, step=self.version)
        if backend.rank == 0:
            repair(store, keys, self.version)  # no later resume loads an uncommitted checkpoint
        if backend.world_size > 1:
            ctx.log.info("rank %d of %d%s", backend.rank, backend.world_size,
                         " (leader)" if backend.rank == 0 else "")
        return backend

    def k(self) -> int:
        """The staleness bound in force at the current version."""
        lc = self.cfg.learner
        return effective_k(lc.max_staleness, self.version, lc.total_steps, lc.halve_staleness_at)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """The leader's loop; the other ranks `follow`."""
        try:
            return self._lead()
        finally:
            try:
                self.buffer.close()
            finally:
                self.close_writes()
            # stop the followers, unless they are inside a collective this rank left by an
            # error: then this rank's exit ends the whole torchrun world
            if self.backend.world_size > 1 and not self.in_step:
                ranks.end(self.backend)

    def close_writes(self) -> None:
        """Wait for the writes in flight (raising their error), then stop the writers."""
        try:
            if self.ctx.metrics is not None:
                self.ctx.metrics.flush()  # behind the last commit, as each flush
            self.writer.close()
        finally:
            if self.ctx.metrics is not None:
                self.ctx.metrics.defer = None
            try:
                self.taken_writer.close()
            finally:
                self.commits.close()

    def _lead(self) -> int:
        ctx, lc, buffer = self.ctx, self.cfg.learner, self.buffer
        # a learner stopped after the commit that converged (or ran out of signal), before
        # DONE.json (or the abort marker): it ends the run as that commit did
        converged = self.solved()
        if not converged and self.without_signal():
            return EXIT_RUN_ABORTED
        while not converged and self.version < lc.total_steps:
            new = buffer.poll(self.version)
            batch = buffer.next_batch(self.version, self.k(), lc.batch_prompts)
            while batch is None and buffer.reading():  # what the batch lacks is being read:
                new = buffer.collect(block=False, first=True) or new  # one read at a time
                batch = buffer.next_batch(self.version, self.k(), lc.batch_prompts)
            if batch is None and ctx.once:  # the round's inputs are all in: step on them
                batch = buffer.whole(self.version, self.k())
            if batch is not None:
                if self.takes_read:
                    self.took(batch)
                started = time.monotonic()
                self.step(batch)
                self.profile.stepping_s += time.monotonic() - started
                if ctx.once and self.version < lc.total_steps:
                    return 0
                if self.solved():
                    converged = True
                    break
                if self.without_signal():
                    return EXIT_RUN_ABORTED
            elif stale := buffer.stale(self.version, self.k()):
                # dropped now, counted in the ledger: they can never be admitted, and waiting
                # for a step to carry them would hold their workers' backlog full
                self.commit(stale, stepped=False)
            elif new:
                if not self.cfg.inline_postprocess:
                    self.writer.submit(buffer.counts().write, ctx.store, ctx.keys.buffered())
            elif (ctx.once and ctx.done()) or ctx.aborted() is not None:
                return 0
            else:
                self.writer.check()  # a failed commit would hold the workers for good
                self.taken_writer.check()
                buffer.wait(lc.poll_interval_s)
        self.writer.wait()
        Done(steps=self.version, counts=dict(self.ledger.counts), time=time.time(),
             staleness=dict(self.ledger.staleness),
             converged=converged).write(ctx.store, ctx.keys.done())
        ctx.log.info("done: %d steps, %s", self.version, dict(self.ledger.counts))
        return 0

    def took(self, batch: Batch) -> None:
        """Record, as the step on `batch` starts, the groups committed or taken so far and the
        learner's time in steps (`Taken`): a worker whose lead counts at the take resumes on
        it, and a standby worker reads from it how long the learner spends between steps,
        waiting for data. Written on a thread of its own, not behind the commits; the step
        waits only for the previous step's record, written long before."""
        groups, kept = self.ledger.groups_with(batch, self.buffer.tallies)
        record = Taken(version=self.version, groups_by_worker=dict(groups),
                       kept_groups_by_worker=dict(kept), stepping_s=self.profile.stepping_s,
                       elapsed_s=time.monotonic() - self.profile.started,
                       learner=self.start_id)
        self.taken_writer.submit(record.write, self.ctx.store, self.ctx.keys.taken())

    def step(self, batch: Batch, every_round: bool | None = None) -> bool:
        """One update on the admitted shards of `batch`, then the batch's commit; whether
        the update changed the weights (replay checks it against the ledger).

        `every_round` (default: a `--once` round) publishes a version even when no update
        was applied (every row filtered, or a non-finite loss): the version is the previous
        weights unchanged, so each round of the synchronous pipeline makes exactly one
        version and the run reaches `total_steps`.
        """
        every_round = self.ctx.once if every_round is None else every_round
        started, cpu_started = time.monotonic(), time.thread_time()
        admitted = [(key, table) for key, table, outcome in batch if outcome == "admitted"]
        table = pa.concat_tables([t for _, t in admitted])
        kept = table.filter(table.column("keep"))
        lag = self.version - pc.min(table.column("policy_version")).as_py()
        k = self.k()  # the bound that admitted this batch (the commit moves the version)
        self.in_step = True
        if self.backend.world_size > 1:
            ranks.Plan(self.version, self.kl.beta, [key for key, _ in admitted]).send(self.backend)
        beta = self.kl.beta
        applied, metrics = self.update(kept, beta)
        if applied and "kl_sum" in metrics:
            self.kl.update(metrics["kl_sum"], len(kept))
        if not applied:
            self.ledger.counts["skipped_steps"] += int(len(kept) > 0)
        self.ledger.lags(self.version, table)
        self.barren.add(table, kept)
        updated = self.profile.updated(started, cpu_started)
        if every_round and not applied:
            self.ledger.counts["unchanged_versions"] += 1
        tokens = policy_tokens(kept)  # before the commit's writer thread wants the lock
        self.commit(batch, stepped=applied or every_round, beta=beta, threads=self.threads,
                    applied=applied)
        self.in_step = False
        metrics.update(
            beta=self.kl.beta, k=float(k),
            stale_dropped=float(self.ledger.counts["stale_dropped"]),
            skipped_steps=float(self.ledger.counts["skipped_steps"]),
        )
        if applied or every_round:  # a new version: its batch's figures are its own
            metrics.update(staleness_max=float(lag), **self.profile.step_metrics(
                started, updated, time.monotonic(), len(kept), tokens))
        # else the version stays: its throughput and timing would be averaged into the
        # figures of the update that made it (a non-finite loss still shows, at the version
        # it was computed on). Its reads, waits and hops count toward the next version's
        # figures, the time that version took; its tokens, not trained on, toward none
        self.ctx.metrics.log(self.version, metrics)
        if applied and self.version % self.cfg.learner.doctor_every == 0:
            self.ctx.metrics.flush()  # the doctor reads the store: include this step
            # (written behind this step's commit, as every flush of the learner's)
            # off the step's path, after the commit: where the commits' writes run (in their
            # child process by default, which keeps its Python off this process's lock)
            self.writer.later(self.commits.run, [Check(self.version)])
        return applied

    def barren_limit(self) -> bool:
        """Whether `max_batches_without_signal` batches' worth of prompt groups in a row had
        none kept by filtering (never in a `--once` round)."""
        lc = self.cfg.learner
        limit = lc.max_batches_without_signal
        return not (self.ctx.once or limit is None
                    or self.barren.groups < limit * lc.batch_prompts)

    def solved(self) -> bool:
        """Whether the policy has converged on its prompts: over the barren limit, every
        sample of every group was correct. Then the run finishes at this version (DONE.json,
        `converged`), as a success: evaluate takes this version as the last and promote
        proceeds. Groups that all failed instead abort the run (`without_signal`)."""
        if not (self.barren_limit() and self.barren.all_correct()):
            return False
        self.ctx.log.info(
            "converged at version %d of %d: in the last %d prompt groups (%d samples) every "
            "sample was correct, so zero-variance filtering kept none and there is nothing "
            "left to learn from these prompts; finishing the run here", self.version,
            self.cfg.learner.total_steps, self.barren.groups, self.barren.rows)
        return True

    def without_signal(self) -> bool:
        """Whether the run has had nothing to learn from for `max_batches_without_signal`
        batches' worth of groups: then the abort marker, with the diagnosis, stops every
        stage (a restart would only generate more of the same)."""
        limit = self.cfg.learner.max_batches_without_signal
        if not self.barren_limit():
            return False
        advice = (
            "The policy solves each of these prompts never (or always): warm-start it "
            "(model.sft), pick an easier task, or sample more per prompt (rollout.group_size)"
            if self.version == 0 else
            f"It trained {self.version} step(s) before this, so the policy most likely "
            f"collapsed rather than met a task too hard (a learning rate too high or a "
            f"sampling temperature too low are the usual causes: `shardrl doctor "
            f"{self.ctx.run_id}` reads the metrics): start again with gentler settings")
        reason = (
            f"nothing to learn from: in the last {self.barren.groups} prompt groups "
            f"({self.barren.rows} samples, mean reward {self.barren.mean_reward():.3f}) every "
            f"sample of a group got the same reward, so zero-variance filtering kept none and "
            f"the policy has not changed since version {self.version}. {advice}; "
            f"learner.max_batches_without_signal = {limit} sets this limit")
        Aborted(stage="learn", exit_code=EXIT_RUN_ABORTED, reason=reason,
                time=time.time()).write_first(self.ctx.store, self.ctx.keys.aborted())
        self.ctx.log.error("stopping the run: %s", reason)
        return True

    def update(self, kept: pa.Table, beta: float) -> tuple[bool, dict[str, float]]:
        """One optimizer step on the kept rows at the current version (every rank).

        (applied, metrics); nothing happens, on every rank alike, when no row is kept.
        """
        lc = self.cfg.learner
        self.threads = []
        if not len(kept):
            return False, {}
        scale = lr_schedule(self.version, warmup_steps=lc.warmup_steps,
                            total_steps=lc.total_steps, kind=lc.schedule, min_ratio=lc.min_lr_ratio)
        self.backend.set_lr("policy", lc.lr * scale)
        if lc.lora is not None and lc.lora.dropout > 0:  # the same masks when resumed or replayed
            torch.manual_seed(self.cfg.seed * 1_000_003 + self.version)
        with self.ctx.cores.busy() as cores:
            self.threads.append(torch.get_num_threads())
            # m: filled as the step consumes the micro-batches' losses, if split
            loss, m = update_loss(self.cfg, self.backend.policy, kept, self.pad_id, beta,
                                  self.backend.critic, self.cfg.learner.backend.kind)
            cores.adjust()  # the backward pass may get cores the generator left meanwhile
            self.threads.append(torch.get_num_threads())
            applied, grad_norm = self.backend.step(loss)
        metrics = {k: float(v) for k, v in m.items()}
        metrics.update(grad_norm=grad_norm, lr=lc.lr * scale)
        return applied, metrics

    def advance(self, stepped: bool) -> tuple[ranks.State | None, dict[str, ranks.State]]:
        """After an applied step: the next version, its weights and any checkpoint due
        (collective: every rank calls it in the same order)."""
        if not stepped:
            return None, {}
        self.version += 1
        # a `--once` learner is a new process each round: its optimizer state must reach the
        # next round's, so every round that steps checkpoints it; LoRA adapters are not in
        # the published (merged) weights, so they are checkpointed with every version
        due = (self.version % self.cfg.learner.ckpt_every == 0 or self.ctx.once
               or self.cfg.learner.lora is not None)
        return ranks.gather(self.backend, self.model, self.leader, due, self.dtype,
                            lend_weights=isinstance(self.commits, CommitProcess))

    def commit(self, batch: Batch, stepped: bool, beta: float | None = None,
               threads: list[int] = (), applied: bool | None = None) -> None:
        """Publish (if `stepped`) and record the batch's shards in the ledger, with whether
        the update was `applied`, its KL coefficient and torch threads (what a replay repeats
        and checks).

        The state is captured now; the writes, in the commit order, go to the background
        writer (see the package docstring).
        """
        weights, files = self.advance(stepped)
        if self.channel is not None and weights is not None:
            self.channel.publish(self.version, weights)
        delta = self.ledger.record(batch, self.buffer.tallies)
        self.buffer.remove(batch)
        self.ledger.forget_below(self.buffer.scanner.low)
        commit = Commit(
            progress=self.ledger.progress(self.version, self.kl.state_dict(), self.kl.beta,
                                          self.barren.state()),
            delta=delta, stepped=stepped, weights=weights, checkpoint=files,
            full_every=self.cfg.learner.publish.full_every,
            buffered=None if self.cfg.inline_postprocess else self.buffer.counts(),
            beta=beta, threads=list(threads), restart=self.restart, applied=applied)
        self.restart = None
        self.writer.submit(commit.write, self.commits, self.ctx.store, self.ctx.keys,
                           self.cfg.learner.keep_checkpoints, self.retention.collect)

    def follow(self) -> int:
        """A non-leader rank: run each step the leader broadcasts, until the empty plan."""
        while (plan := ranks.Plan.receive(self.backend)) is not None:
            table = pa.concat_tables([read_shard(self.ctx.store, key, READY, COLUMNS)
                                      for key in plan.shards])
            self.version = plan.version
            applied, _ = self.update(table.filter(table.column("keep")), plan.beta)
            self.advance(applied or self.ctx.once)  # as the leader's `step` does
        return 0


def resumable_state(state: Mapping[str, torch.Tensor], ckpt: int, version: int,
                    ) -> Mapping[str, torch.Tensor]:
    """A checkpoint's backend state for a learner resuming at the committed `version`: the
    policy's float32 masters (DeepSpeed's bf16) only when the checkpoint is of that version.
    An older checkpoint's would put the policy back to its step (the engine copies the
    masters into the weights at the next update); the policy is the committed version's,
    its published weights, and its masters are rebuilt from them."""
    if ckpt == version:
        return state
    return _Subset(state, [k for k in state
                           if not (k.startswith(f"{POLICY}/") and k.endswith(f"/{MASTER}"))])


class _Subset(Mapping[str, torch.Tensor]):
    """The entries `names` of `state`, each read from it only when asked for."""

    def __init__(self, state: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self._state, self._names = state, dict.fromkeys(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:  # without reading the entry
        return name in self._names


class Barren:
    """Prompt groups committed in a row without one kept by filtering (admitted shards)."""

    def __init__(self) -> None:
        self.groups = self.rows = self.correct = 0
        self.reward = 0.0
        """Sum of the rows' `reward_total`."""

    @classmethod
    def resumed(cls, state: dict[str, float]) -> Barren:
        """The count a commit recorded (`Progress.no_signal`, `state`); empty: none."""
        barren = cls()
        barren.groups = int(state.get("groups", 0))
        barren.rows = int(state.get("rows", 0))
        barren.correct = int(state.get("correct", 0))
        barren.reward = float(state.get("reward", 0.0))
        return barren

    def state(self) -> dict[str, float]:
        """What a commit records (`resumed` reads it back); empty while the count is 0."""
        if not self.groups:
            return {}
        return {"groups": self.groups, "rows": self.rows, "correct": self.correct,
                "reward": self.reward}

    def add(self, table: pa.Table, kept: pa.Table) -> None:
        """Count a step's admitted rows (`table`); a step with any kept row ends the run."""
        if len(kept):
            self.groups = self.rows = self.correct = 0
            self.reward = 0.0
            return
        self.groups += len(pc.unique(table.column("group_id")))
        self.rows += len(table)
        self.correct += int(pc.sum(table.column("correct")).as_py() or 0)
        self.reward += float(pc.sum(table.column("reward_total")).as_py() or 0.0)

    def mean_reward(self) -> float:
        return self.reward / self.rows if self.rows else 0.0

    def all_correct(self) -> bool:
        """Whether the run of rows is non-empty and every row was correct (the verifiers')."""
        return self.rows > 0 and self.correct == self.rows
