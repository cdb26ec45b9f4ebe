"""prepare: reward shaping, group advantages, zero-variance filtering, pass-rate history."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from ..algo import (
    PassRateTracker,
    RunningMoments,
    get_advantage_estimator,
    kl_penalty,
    normalized_scores,
    shape_rewards,
    shard_norm,
    zero_variance_keep,
)
from ..store.keys import shard_name, shard_numbers
from ..store.records import (
    PassRateSnapshot,
    PrepareState,
    Progress,
    RetiredChange,
    RetiredPrompts,
)
from ..store.schemas import READY, SCORED
from ..store.shards import ShardError, read_shard, write_shard
from .batch import POLICY_MASK, padded_column
from .context import StageContext
from .scan import Scanner, output_names, process_shards

STATE = "state.json"
RECENT = 1024  # merged shard names remembered for exact recovery after a crash
SNAPSHOT_MIN, SNAPSHOT_MAX = 8, 256
"""Ready shards between two snapshots of the pass-rate history (see `Preparer.record`)."""


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    ctx.wait_for_run()
    prep = Preparer(ctx)
    scanner = Scanner(store, keys, cfg, "prepare", output_names(store, keys, "ready"))
    prep.recover(scanner.low, ctx.latest_version() or 0)

    def handle(key: str, table: pa.Table) -> None:
        ready = prep.prepare(table)
        write_shard(store, keys.ready_for(key), ready, READY)
        prep.merged(key, ready)

    return process_shards(ctx, scanner, SCORED, handle, cfg.prepare.poll_interval_s)


def ready_columns(table: pa.Table, shape) -> pa.Table:
    """`table` with reward_total, advantage, keep and filter_reason: rows whose numbers are
    not finite are filtered with their reason; `shape` (a table -> `shape_shard`'s tuple)
    sees only the others."""
    reasons = invalid_rows(table)
    valid = np.array([r is None for r in reasons], dtype=bool)  # (B,)
    total = np.zeros(len(table), np.float32)  # (B,)
    adv = np.zeros(len(table), np.float32)  # (B,)
    keep = np.zeros(len(table), bool)  # (B,)
    if valid.any():
        sub_total, sub_adv, sub_keep, sub_reasons = shape(table.filter(pa.array(valid)))
        total[valid], adv[valid], keep[valid] = sub_total, sub_adv, sub_keep
        for i, reason in zip(np.flatnonzero(valid).tolist(), sub_reasons, strict=True):
            reasons[i] = reason
    out = table.append_column("reward_total", pa.array(total, pa.float32()))
    out = out.append_column("advantage", pa.array(adv, pa.float32()))
    out = out.append_column("keep", pa.array(keep, pa.bool_()))
    return out.append_column("filter_reason", pa.array(reasons, pa.string()))


def shape_shard(algo, reward_rm: torch.Tensor, group_ids: torch.Tensor, moments: RunningMoments,
                kl_seq: torch.Tensor, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                            list]:
    """(reward_total, advantage, keep, filter_reason) of one shard's rows with finite numbers.

    reward_rm, group_ids (int64), kl_seq: (B,); `moments` already hold this shard's rewards
    (used only with `algo.shaping.normalize`). Group advantages get prepare's part of the
    configured normalization (`shard_norm`); GAE's are left 0 for the learner.
    """
    total = shape_rewards(reward_rm, kl_seq,
                          moments=moments if algo.shaping.normalize else None,
                          clip=algo.shaping.clip, alpha=algo.shaping.alpha, beta=beta,
                          clip_before_norm=algo.shaping.clip_before_norm)
    if algo.advantages.estimator == "group":
        ones = torch.ones((len(total), 1))  # one position per sample: (B, 1)
        adv = get_advantage_estimator("group")(total, ones, group_ids=group_ids,
                                               norm=shard_norm(algo.advantages.norm))[0][:, 0]
    else:  # GAE: per-token advantages need the critic, computed by the learner
        adv = torch.zeros_like(total)
    if algo.filters.zero_variance:
        keep = zero_variance_keep(reward_rm, group_ids, algo.filters.zero_variance_tol)
        if algo.advantages.estimator == "group":  # shaping (a clip) can make unequal scores
            # equal: such a group's advantages are all 0, no signal either
            keep &= zero_variance_keep(total, group_ids, algo.filters.zero_variance_tol)
    else:
        keep = torch.ones_like(reward_rm, dtype=torch.bool)
    finite = torch.isfinite(total) & torch.isfinite(adv)
    reasons = [None if k and f else ("non_finite" if not f else "zero_variance")
               for k, f in zip(keep.tolist(), finite.tolist(), strict=True)]
    keep = keep & finite
    # an overflowed row is written as 0, not as float32's largest value: it trains on nothing
    return (torch.where(finite, total, 0.0).numpy(), torch.where(finite, adv, 0.0).numpy(),
            keep.numpy(), reasons)


@dataclass
class StateWrites:
    """What one recorded ready shard changes in the store (see `Preparer.record`)."""

    state: PrepareState | None = None
    snapshot: tuple[int, PassRateSnapshot] | None = None
    retired: tuple[int, RetiredChange] | None = None
    obsolete: list[str] = field(default_factory=list)
    """Keys deleted once the state is written (an older snapshot, older retired changes)."""


class Preparer:
    """Holds the running reward statistics and pass-rate history; both survive restarts."""

    def __init__(self, ctx: StageContext, state: str = STATE) -> None:
        self.ctx = ctx
        npr = ctx.cfg.algo.filters.no_positive_resampling
        self.moments = RunningMoments()
        self.tracker = None
        """Pass-rate history per prompt, kept (and persisted) only for No-Positive-Resampling."""
        if npr.enabled:
            self.tracker = PassRateTracker(window=npr.window, retire_at=npr.retire_at,
                                           min_samples=npr.min_samples)
        self.stateful = ctx.cfg.algo.shaping.normalize or self.tracker is not None
        """Whether it keeps statistics across shards (reward moments, the pass-rate history).
        Without them a ready shard depends on its scored shard alone: nothing is saved per
        shard and nothing recovered after a crash (one store write fewer per shard)."""
        self.state_key = ctx.keys.state("prepare", state)
        saved = PrepareState.read(ctx.store, self.state_key)
        if saved.moments:
            self.moments.load_state_dict(saved.moments)
        self.recent = saved.recent
        self.forgotten = dict(saved.forgotten)
        self.snapshot, self.replay = saved.passrate_snapshot, saved.replay
        self.retired_changes = saved.retired_changes
        if self.tracker is not None:
            self._load_history()

    def _load_history(self) -> None:
        """The pass-rate history: its last snapshot, then the outcomes of the ready shards
        merged since (a ready shard the learner quarantined since is skipped), and every
        retirement published: one that shard brought stays, for good."""
        store, keys = self.ctx.store, self.ctx.keys
        if self.snapshot is not None:
            snap = PassRateSnapshot.read(store, keys.passrate_snapshot(self.snapshot))
            self.tracker.load_state_dict(snap.model_dump())
        for key in self.replay:
            if store.exists(key) and (table := self._readable(key)) is not None:
                self.tracker.update(table.column("prompt_id").to_pylist(),
                                    table.column("correct").to_pylist())
        published = RetiredPrompts(store, keys)
        self.tracker.keep_retired(published.refresh())
        if published.last is not None:  # a change written before a crash took its state's
            # write along: the next is numbered past it, never over it
            newest = int(published.last.rsplit("/", 1)[1].removesuffix(".json"))
            self.retired_changes = max(self.retired_changes, newest + 1)

    def recover(self, low: int, newest: int, only: str = "") -> None:
        """Merge statistics of ready shards written just before a crash but not yet saved
        (of those whose name starts with `only`)."""
        if not self.stateful:
            return
        known = set(self.recent)
        keys = self.ctx.keys
        for version in range(low, newest + 1):
            for key in self.ctx.store.list(keys.version_prefix("ready", version)):
                if (shard_name(key) not in known and shard_name(key).startswith(only)
                        and not self._forgotten(key)
                        and (ready := self._readable(key)) is not None):
                    self.ctx.log.info("recovering statistics of %s", key)
                    self.merged(key, ready, update_moments=True)

    def _readable(self, key: str) -> pa.Table | None:
        """Ready shard `key`, or None when it does not read (the learner quarantines it and
        trains on none of it, so its statistics are left out too, with a warning): a
        preparer that raised here would fail at every restart until then."""
        try:
            return read_shard(self.ctx.store, key, READY)
        except ShardError as exc:
            self.ctx.log.warning("ready shard %s does not read, its statistics are left out "
                                 "(%s)", key, exc)
            return None

    def _forgotten(self, key: str) -> bool:
        """Whether ready shard `key` was merged so long ago that `recent` no longer names it
        (a window of more than `RECENT` shards). It takes a worker's shards to be merged
        in about the order of their numbers: one merged more than `RECENT` shards after a
        higher-numbered one of its worker, and not yet saved at a crash, would be taken
        for merged."""
        worker, seq = shard_numbers(shard_name(key))
        return seq <= self.forgotten.get(worker, -1)

    def prepare(self, table: pa.Table) -> pa.Table:
        """The ready shard of a scored one. Rows whose reward or logprobs are not finite are
        filtered with their reason and take no part in the statistics or the advantages."""
        out = ready_columns(table, self._shape)
        valid = np.array([r not in UNUSABLE for r in out.column("filter_reason").to_pylist()],
                         dtype=bool)  # (B,)
        adv = out.column("advantage").to_numpy()
        keep = out.column("keep").to_numpy(zero_copy_only=False)
        self._log(out, torch.from_numpy(adv[valid]), torch.from_numpy(keep))
        return out

    def _shape(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """(reward_total, advantage, keep, filter_reason) of rows with finite numbers."""
        cfg = self.ctx.cfg
        algo = cfg.algo
        reward_rm = torch.tensor(table.column("reward_rm").to_numpy(), dtype=torch.float32)
        group_ids = torch.from_numpy(
            np.unique(table.column("group_id").to_numpy(zero_copy_only=False),
                      return_inverse=True)[1].astype(np.int64))
        kl_seq = torch.zeros_like(reward_rm)
        beta = 0.0
        # a sequence-level KL term in the reward; with GAE the learner puts the KL on each
        # token at its current beta (`update.gae_rewards`), so the total holds the score only
        if algo.kl.placement == "reward" and algo.advantages.estimator != "gae":
            kl_seq = self._kl_seq(table)
            beta = Progress.read(self.ctx.store, self.ctx.keys.progress()).beta
            beta = _init_beta(algo.kl.controller) if beta is None else beta
        if algo.shaping.normalize:
            self.moments.update(normalized_scores(reward_rm, algo.shaping.clip,
                                                  algo.shaping.clip_before_norm))
        return shape_shard(algo, reward_rm, group_ids, self.moments, kl_seq, beta)

    def merged(self, key: str, ready: pa.Table, update_moments: bool = False) -> None:
        """Record a written ready shard (of shard `key`) in the persisted state, and its
        statistics if recovering."""
        shaping = self.ctx.cfg.algo.shaping
        if update_moments and shaping.normalize:
            valid = [r not in INVALID for r in ready.column("filter_reason").to_pylist()]
            scores = torch.tensor(ready.column("reward_rm").to_numpy()[valid])
            self.moments.update(normalized_scores(scores, shaping.clip, shaping.clip_before_norm))
        self.save(self.record(key, ready))

    def record(self, key: str, ready: pa.Table) -> StateWrites:
        """Add the ready shard of shard `key` (any kind) to the statistics and the pass-rate
        history; what to `save` once the ready shard is written.

        The history is stored incrementally: the ready shards merged since its last
        snapshot are its log (their prompt ids and outcomes), and a new snapshot is due once
        that log holds as many samples as the history has prompts (at least `SNAPSHOT_MIN`
        and at most `SNAPSHOT_MAX` shards), so writing it costs a bounded amount per sample.
        Changes of the retired set go to numbered files; a snapshot writes the whole set and
        the earlier changes are deleted.
        """
        writes = StateWrites()
        if not self.stateful:
            return writes
        ready_key = self.ctx.keys.ready_for(key)
        self.recent.append(shard_name(ready_key))
        for name in self.recent[:-RECENT]:  # the oldest, dropped: remembered by number
            worker, seq = shard_numbers(name)
            self.forgotten[worker] = max(seq, self.forgotten.get(worker, -1))
        self.recent = self.recent[-RECENT:]
        if self.tracker is not None:
            added = self.tracker.update(ready.column("prompt_id").to_pylist(),
                                        ready.column("correct").to_pylist())
            self.replay.append(ready_key)
            logged = len(self.replay) * max(1, len(ready))
            if len(self.replay) >= SNAPSHOT_MAX or (len(self.replay) >= SNAPSHOT_MIN
                                                    and logged >= len(self.tracker)):
                if self.snapshot is not None:
                    writes.obsolete.append(self.ctx.keys.passrate_snapshot(self.snapshot))
                self.snapshot = (self.snapshot or 0) + 1
                writes.snapshot = (self.snapshot,
                                   PassRateSnapshot.model_validate(self.tracker.state_dict()))
                self.replay = []
                writes.retired = (self.retired_changes,
                                  RetiredChange(full=True, add=sorted(self.tracker.retired())))
                self.retired_changes += 1
            elif added:
                writes.retired = (self.retired_changes, RetiredChange(add=sorted(added)))
                self.retired_changes += 1
        writes.state = PrepareState(
            moments={k: float(v) for k, v in self.moments.state_dict().items()},
            recent=list(self.recent), forgotten=dict(self.forgotten),
            passrate_snapshot=self.snapshot, replay=list(self.replay),
            retired_changes=self.retired_changes)
        return writes

    def save(self, writes: StateWrites) -> None:
        """Persist what `record` captured: the snapshot and the retired change first, then
        the state that names them, then the deletion of what they replace."""
        store, keys = self.ctx.store, self.ctx.keys
        if writes.snapshot is not None:
            n, snap = writes.snapshot
            snap.write(store, keys.passrate_snapshot(n))
        if writes.retired is not None:
            n, change = writes.retired
            change.write(store, keys.retired_change(n))
        if writes.state is None:  # stateless (see `stateful`)
            return
        writes.state.write(store, self.state_key)
        if writes.retired is not None and writes.retired[1].full:
            newest = keys.retired_change(writes.retired[0])
            writes.obsolete += [k for k in store.list(keys.retired_prefix()) if k < newest]
        for key in writes.obsolete:
            store.delete(key)

    def _kl_seq(self, table: pa.Table) -> torch.Tensor:
        behaviour = torch.from_numpy(padded_column(table, "behavior_logprobs"))
        ref = torch.from_numpy(padded_column(table, "ref_logprobs"))
        width = min(behaviour.shape[1], ref.shape[1])
        lengths = torch.tensor([len(r) for r in table.column("response_token_ids").to_pylist()])
        mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
        if POLICY_MASK in table.column_names:  # episodes: the environment's tokens are out
            policy = torch.from_numpy(padded_column(table, POLICY_MASK))[:, :width]
            mask[:, : policy.shape[1]] *= policy
        kl = kl_penalty(behaviour[:, :width], ref[:, :width], self.ctx.cfg.algo.kl.estimator)
        return (kl * mask).sum(-1)

    def _log(self, table: pa.Table, adv: torch.Tensor, keep: torch.Tensor) -> None:
        """Metrics of one shard; reward and advantage statistics cover the usable rows only."""
        valid = [r not in UNUSABLE for r in table.column("filter_reason").to_pylist()]
        total = table.column("reward_total").to_numpy()[valid]
        version = int(table.column("policy_version")[0].as_py())
        values = {
            "effective_sample_rate": float(keep.float().mean()),
            "filter_rate": float(1.0 - keep.float().mean()),
        }
        if self.tracker is not None:
            rates = [r for r in (self.tracker.pass_rate(p) for p in
                                 set(table.column("prompt_id").to_pylist())) if r is not None]
            values["retired_prompts"] = float(self.tracker.retired_count())
            values["prompt_pass_rate_mean"] = float(np.mean(rates)) if rates else 0.0
        if len(adv):  # none when every row of the shard is invalid
            values.update({
                "reward_total_mean": float(total.mean()), "reward_total_std": float(total.std()),
                "advantage_mean": float(adv.mean()),
                "advantage_std": float(adv.std()) if len(adv) > 1 else 0.0,
                "advantage_abs_max": float(adv.abs().max()),
            })
        self.ctx.metrics.log(version, values)


INVALID = ("non_finite_reward", "non_finite_logprobs")
"""filter_reason of rows whose numbers cannot be trained on (kept out of every statistic)."""
UNUSABLE = (*INVALID, "non_finite")
"""filter_reason of the rows left out of the logged reward and advantage statistics: those of
`INVALID`, and rows whose shaped reward or advantage overflowed."""


def invalid_rows(table: pa.Table) -> list[str | None]:
    """Per row: None, or why its reward or its behaviour/reference logprobs are unusable."""
    reasons: list[str | None] = [None] * len(table)
    lp_ok = np.ones(len(table), bool)  # (B,)
    for column in ("behavior_logprobs", "ref_logprobs"):
        if table.column(column).null_count == 0:
            lp_ok &= np.isfinite(padded_column(table, column)).all(axis=1)
    reward_ok = np.isfinite(table.column("reward_rm").to_numpy())  # (B,)
    for i in np.flatnonzero(~lp_ok).tolist():
        reasons[i] = INVALID[1]
    for i in np.flatnonzero(~reward_ok).tolist():
        reasons[i] = INVALID[0]
    return reasons


def _init_beta(controller) -> float:
    return float(getattr(controller, "beta", getattr(controller, "init_beta", 0.0)))
