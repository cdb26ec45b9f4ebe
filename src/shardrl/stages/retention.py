"""Which published policy versions stay in the store; the learner deletes the others.

A version is needed while an admissible shard may still come from it (`gc_horizon`); a
version the evaluator owes an evaluation, until it has one; and an evaluated version while
promotion could still choose it, that is unless another evaluated version ranks above it
(`promote.choose: best`: a higher `promote.metric`, or an equal one and newer; `last`: any
newer one). Whatever ranks first at the end was never outranked, so promotion always finds
its weights. Version 0 is the snapshot whose config and tokenizer every stage loads: kept.
A run therefore keeps about `k + 2` recent versions and the best evaluated one however
long it runs.
"""

from __future__ import annotations

from ..config import RunConfig
from ..store import RunKeys, Store
from ..store.keys import folder_number
from .evaluate import latest_evaluated, next_wanted, wanted
from .staleness import gc_horizon


def outranked(version: int, summaries: dict[int, float], how: str) -> bool:
    """Whether promotion (`how`: best or last) prefers another of the evaluated `summaries`
    ({version: metric}) over `version` (which is one of them)."""
    if how == "last":
        return any(v > version for v in summaries)
    mine = (summaries[version], version)
    return any((m, v) > mine for v, m in summaries.items())


class Retention:
    """The learner's deletion of policy versions (see the module docstring)."""

    def __init__(self, store: Store, keys: RunKeys, cfg: RunConfig, version: int) -> None:
        self.store, self.keys, self.cfg = store, keys, cfg
        self.summaries: dict[int, float] = {}
        """{evaluated version: its promote.metric}, read once each."""
        self.next_read: int | None = 0
        """The first wanted version whose summary is not read yet."""
        present = {v for k in store.list(keys.root + "policy/")
                   if (v := folder_number(k, "policy")) is not None}
        horizon = gc_horizon(version, cfg.learner.max_staleness)
        self.waiting = sorted(v for v in present if 0 < v <= horizon)
        """Versions past the horizon kept for evaluation or promotion (after a restart: all
        that earlier runs of the learner kept)."""

    def collect(self, version: int) -> list[int]:
        """After the commit of `version`: delete what nothing can need any more; the deleted
        versions."""
        old = gc_horizon(version, self.cfg.learner.max_staleness)
        deleted = []
        if old > 0:
            if wanted(old, self.cfg.eval.every, self.cfg.learner.total_steps):
                self.waiting.append(old)
            else:
                self._delete(old)
                deleted.append(old)
        if self.waiting:
            self._read_summaries()
            how = self.cfg.promote.choose
            drop = [v for v in self.waiting
                    if v in self.summaries and outranked(v, self.summaries, how)]
            for v in drop:
                self._delete(v)
                self.waiting.remove(v)
            deleted += drop
        return deleted

    def _read_summaries(self) -> None:
        """Summaries of the versions evaluated since the last call (the evaluator goes in
        increasing order and names the newest it finished)."""
        newest = latest_evaluated(self.store, self.keys)
        every, total = self.cfg.eval.every, self.cfg.learner.total_steps
        while (self.next_read is not None and newest is not None
               and self.next_read <= newest):
            key = self.keys.eval_summary(self.next_read)
            if self.store.exists(key):  # absent: the evaluator could not evaluate it
                self.summaries[self.next_read] = float(
                    self.store.get_json(key)[self.cfg.promote.metric])
            self.next_read = next_wanted(self.next_read, every, total)

    def _delete(self, version: int) -> None:
        for key in self.store.list(self.keys.policy_prefix(version)):
            self.store.delete(key)
