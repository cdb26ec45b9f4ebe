"""Replay: the learner re-run offline from a finished (or running) run's ledger.

The ledger deltas (`state/learn/ledger-<n>.json`) say which ready shards each commit took, in
the order the step concatenated them, whether the step was applied, the KL coefficient it
used and the torch threads of its forward and backward; the first commit of a restarted
learner also says which checkpoint its optimizer state came from. A replay starts a new run
from the source's policy v0 (and reference), then, for every delta in order, reads those
shards from the source run and hands them to the learner's own `Learner.step` (or `commit`,
for a delta of stale drops only): the same update, commit order, metrics and retention as a
live learner, writing the new run's versions, ledger and metrics.

Bit-exactness holds when every input of the arithmetic is the same: the shards and their
order (the ledger), v0, the config, the seed, the backend (the torch backend; a DeepSpeed
run replays on it too, not bit for bit), the torch build and the torch threads of each
update (CPU reductions split by thread count; the delta records them and `ReplayCores`
sets them). `--verify` compares each version the source still holds (retention deletes
most) with the replay's, both as published, bit for bit, and stops at the first
difference: the version and the tensor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...config import RunConfig
from ...store import RunKeys, Store, StoreError
from ...store.records import (
    LedgerDelta,
    Progress,
    ReplayCheck,
    ReplaySource,
    TensorDifference,
    committed_deltas,
)
from ...store.schemas import READY
from ...store.shards import read_shard
from ..checkpoint import latest_checkpoint
from ..context import MetricsSink, StageContext
from ..policy import MANIFEST, fetch_weights, point_latest
from .buffer import COLUMNS, Batch

log = logging.getLogger("shardrl.replay")

REPLAYABLE = ("algo", "learner", "eval", "doctor", "name")
"""Config sections `--set` may change: a replay trains on the source's shards from its v0."""

NOT_REPLAYED = {
    "algo.filters": "prepare applied them to the shards the replay reads",
    "algo.shaping": "prepare applied it to the shards the replay reads",
    "algo.advantages": "prepare computed the shards' advantages (or left them to a critic)",
    "algo.kl.placement": "a KL term in the reward is in the shards' rewards already",
    "algo.kl.estimator": "a KL term in the reward is in the shards' rewards already",
    "learner.total_steps": "the replay takes the run's commits (--to-version stops earlier)",
    "learner.batch_prompts": "the run's ledger says which shards each step took",
    "learner.max_staleness": "the run's ledger says which shards each step took",
    "learner.halve_staleness_at": "the run's ledger says which shards each step took",
}
"""Settings inside those sections that a replay cannot change, and why: the shards it reads
and the steps it takes are the run's."""


def not_replayed(override: str) -> str | None:
    """Why `--set KEY=VALUE` cannot apply to a replay (None when it can): a section outside
    `REPLAYABLE`, a setting of `NOT_REPLAYED`, or a whole section holding one."""
    key = override.split("=", 1)[0].strip()
    if key.split(".")[0] not in REPLAYABLE:
        return f"only {', '.join(REPLAYABLE)} may change (the replay trains on the run's shards)"
    for fixed, why in NOT_REPLAYED.items():
        if key == fixed or key.startswith(fixed + "."):
            return why
        if fixed.startswith(key + "."):
            return f"it holds {fixed}, which cannot change: {why}; set the keys one by one"
    return None


class ReplayCores:
    """Stands in for the learner's `CoreShare`: each update runs its forward and its backward
    on the thread counts the source's ledger recorded for that step."""

    def __init__(self, default: int) -> None:
        self.default = default
        self.forward = self.backward = default

    def use(self, threads: list[int]) -> None:
        """The next update's (forward, backward) threads; the configured ones if unrecorded."""
        self.forward, self.backward = (threads[0], threads[-1]) if threads else (
            self.default, self.default)

    @contextmanager
    def busy(self) -> Iterator[ReplayCores]:
        torch.set_num_threads(self.forward)
        yield self

    def adjust(self) -> int:
        torch.set_num_threads(self.backward)
        return self.backward


def ledger_deltas(store: Store, keys: RunKeys) -> list[LedgerDelta]:
    """Every committed delta of run `keys`, in commit order (not one its learner wrote
    before it stopped short of the commit's `progress.json`)."""
    commits = Progress.read(store, keys.progress()).commits
    return committed_deltas(store, keys.ledger_prefix(), commits)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (compares bit patterns)."""
    t = t.contiguous().reshape(-1)
    if not t.dtype.is_floating_point:
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def first_difference(version: int, mine: dict[str, torch.Tensor],
                     theirs: dict[str, torch.Tensor]) -> TensorDifference | None:
    """The first tensor (in name order) whose bits differ between two state dicts."""
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
            present = a if a is not None else b
            return TensorDifference(version=version, tensor=name, elements=present.numel(),
                                    max_abs_diff=None)
        differ = _bits(a) != _bits(b)
        if bool(differ.any()):
            gap = (a.reshape(-1)[differ].double() - b.reshape(-1)[differ].double()).abs()
            return TensorDifference(version=version, tensor=name, elements=int(differ.sum()),
                                    max_abs_diff=float(gap.max()))
    return None


@dataclass
class Replay:
    """Re-runs the learner of run `source` into the new run `target` (same store)."""

    store: Store
    source: str
    target: str
    cfg: RunConfig
    overrides: tuple[str, ...] = ()
    to_version: int | None = None
    verify: bool = False

    def __post_init__(self) -> None:
        self.src, self.dst = RunKeys(self.source), RunKeys(self.target)
        self.check = ReplayCheck(source=self.source)
        self.started = False
        """Whether `start_run` began writing the new run (`remove_started` may delete it)."""
        self.departures: list[str] = []
        """Where the replay departed from the run's record (a verify stops at the first)."""

    # -- the new run ------------------------------------------------------------------------
    def start_run(self, run_json: dict) -> None:
        """The new run: the source's v0 and reference, its run.json with the replay's config,
        and `state/replay/source.json`."""
        from ... import __version__

        store, src, dst = self.store, self.src, self.dst
        if store.list(dst.root, limit=1):  # its run.json, or anything else of it
            raise SystemExit(f"run {self.target} exists already: choose another --run-id")
        self.started = True
        for prefix, to in ((src.ref_prefix(), dst.ref_prefix()),
                           (src.policy_prefix(0), dst.policy_prefix(0))):
            keys = store.list(prefix)
            # the manifest last, as `upload_folder` writes it: a reader sees a whole folder
            for key in sorted(keys, key=lambda k: k.endswith(MANIFEST)):
                store.put_bytes(to + key[len(prefix):], store.get_bytes(key))
        point_latest(store, dst, 0)
        ReplaySource(run_id=self.source, to_version=self.to_version,
                     overrides=list(self.overrides)).write(store, dst.replay_source())
        store.put_json(dst.run_json(), {
            "run_id": self.target, "version": __version__, "created": time.time(),
            "config": self.cfg.model_dump(mode="json"), "config_hash": self.cfg.config_hash(),
            "sft": run_json.get("sft"), "snapshot_seconds": 0.0, "replay_of": self.source})

    def remove_started(self) -> int:
        """Delete what `start_run` and `run` wrote of the new run (a replay that failed:
        the target did not exist before `start_run`); how many objects."""
        if not self.started:
            return 0
        try:
            keys = self.store.list(self.dst.root)
            for key in sorted(keys, key=lambda k: k == self.dst.run_json()):  # run.json last
                self.store.delete(key)
        except StoreError as exc:  # the store down: the failure that led here is the news
            log.warning("could not remove the failed replay's run %s: %s", self.target, exc)
            return 0
        return len(keys)

    def context(self) -> StageContext:
        ctx = StageContext(stage="learn", cfg=self.cfg, run_id=self.target, store=self.store,
                           log=logging.getLogger("shardrl.learn"),
                           cores=ReplayCores(self.cfg.learner.threads))
        ctx.metrics = MetricsSink(self.store, self.dst, "learn", 0)
        return ctx

    # -- the learner ------------------------------------------------------------------------
    def run(self) -> ReplayCheck:
        """Replay every delta up to `to_version`; with `verify`, stop at the first difference."""
        from ...store.records import Done
        from .loop import Learner

        deltas = [d for d in ledger_deltas(self.store, self.src)
                  if self.to_version is None or d.version <= self.to_version]
        torch.manual_seed(self.cfg.seed)  # as the learn stage seeds worker 0
        ctx = self.context()
        learner = Learner(ctx)
        try:
            for delta in deltas:
                if not self._commit(learner, delta):  # a verify that found a difference
                    break
            learner.writer.wait()
            Done(steps=learner.version, counts=dict(learner.ledger.counts), time=time.time(),
                 staleness=dict(learner.ledger.staleness)).write(self.store, self.dst.done())
        finally:
            learner.close_writes()
            ctx.metrics.flush()
            ctx.close()
        if self.verify:
            self.check.write(self.store, self.dst.replay_check())
        return self.check

    def _commit(self, learner, delta: LedgerDelta) -> bool:
        """Repeat one recorded commit; False when a verify stops (the replay departs from
        the record, or its weights differ). Without `verify` a departure is recorded and the
        commit still made, so that every commit of the run is replayed."""
        if delta.restart is not None and not self._restart(learner, delta):
            return False
        batch: Batch = [(e.key, read_shard(self.store, e.key, READY, COLUMNS), e.outcome)
                        for e in delta.shards]
        if any(outcome == "admitted" for _, _, outcome in batch):
            at = learner.version
            if (delta.beta is not None and learner.kl.beta != delta.beta and not self.overrides
                    and not self._diverged(f"v{at}: KL coefficient {learner.kl.beta!r}, the "
                                           f"run used {delta.beta!r}")):
                return False
            learner.ctx.cores.use(delta.threads)
            # a `--once` round always steps
            applied = learner.step(batch, every_round=delta.stepped)
            stepped = learner.version > at
            if stepped != delta.stepped and not self.overrides and not self._diverged(
                    f"v{at}: the step was {'applied' if stepped else 'skipped'}, the run's "
                    "was not"):
                return False
            if (delta.applied is not None and applied != delta.applied and not self.overrides
                    # a `--once` round publishes either way: only the update itself tells
                    and not self._diverged(
                        f"v{at}: the update was {'applied' if applied else 'skipped'} (the "
                        f"weights {'changed' if applied else 'kept'}), the run's was not")):
                return False
            if stepped and self.verify:
                return self._compare(learner, learner.version)
        else:
            learner.commit(batch, stepped=False)
        return True

    def _restart(self, learner, delta: LedgerDelta) -> bool:
        """The source's learner restarted here: resume as it did, weights from the last
        version and optimizer moments from the checkpoint it found. When the replay has no
        such checkpoint (another `learner.ckpt_every`), a departure: the replay goes on with
        its own state unless it verifies."""
        wanted = delta.restart.checkpoint
        if wanted is not None and wanted == learner.version:
            return True  # a checkpoint of the state itself (a `--once` round): nothing changes
        learner.writer.wait()
        if latest_checkpoint(self.store, self.dst) != wanted:
            return self._diverged(f"v{learner.version}: the run's learner resumed with the "
                                  f"optimizer state of step {wanted}, which the replay lacks")
        learner.backend = learner._resume_backend()
        return True

    def _compare(self, learner, version: int) -> bool:
        if not self.store.exists(self.src.policy_file(version, MANIFEST)):
            self.check.missing.append(version)
            return True
        learner.writer.wait()  # the replay's version is published
        theirs = fetch_weights(self.store, self.src, version)
        mine = fetch_weights(self.store, self.dst, version)
        self.check.checked.append(version)
        self.check.first_difference = first_difference(version, mine, theirs)
        return self.check.first_difference is None

    def _diverged(self, why: str) -> bool:
        """Record a departure from the run's record; whether the replay goes on (not when
        it verifies: it stops at the first)."""
        if self.check.divergence is None:
            self.check.divergence = why
        self.departures.append(why)
        return not self.verify

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self) -> None:
        """Held-out evaluations of the new run's versions, as the evaluate stage owes them."""
        from .. import evaluate

        ctx = StageContext(stage="evaluate", cfg=self.cfg, run_id=self.target,
                           store=self.store, once=True, log=logging.getLogger("shardrl.evaluate"))
        ctx.metrics = MetricsSink(self.store, self.dst, "evaluate", 0)
        torch.set_num_threads(self.cfg.eval.threads)
        try:
            evaluate.main(ctx, confirm=False)  # a replayed run is compared, not promoted
        finally:
            ctx.metrics.flush()
            ctx.close()
