"""Which published policy versions stay in the store; the learner deletes the others.

A version is needed while an admissible shard may still come from it (`gc_horizon`); a
version the evaluator owes an evaluation, until it has one; and an evaluated version while
promotion could still choose it, that is unless another evaluated version ranks above it
(`promote.choose: best`: a higher `promote.metric`, or an equal one and newer; `last`: any
newer one). Whatever ranks first at the end was never outranked, so promotion always finds
its weights. Version 0 is the snapshot whose config and tokenizer every stage loads: kept.

A version that is a delta needs its chain: the full snapshot before it and every delta
between (`learner.publish.full_every`). So a needed version keeps its whole chain, and a
version goes only when no needed version's chain includes it. A run therefore keeps about
`k + 2` recent versions and the full snapshots and deltas before them, and the best
evaluated one with its chain, however long it runs.
"""

from __future__ import annotations

import math

from ..config import RunConfig
from ..store import RunKeys, Store
from ..store.keys import folder_number
from .evaluate import latest_evaluated, next_wanted, wanted
from .policy import full_base
from .staleness import gc_horizon


def ranking(metric: float, version: int) -> tuple[float, int]:
    """How promotion orders evaluated versions under `choose: best`: by their metric, a NaN
    below every number, then the later version."""
    return (-math.inf if math.isnan(metric) else metric, version)


def outranked(version: int, summaries: dict[int, float], how: str) -> bool:
    """Whether promotion (`how`: best or last) prefers another of the evaluated `summaries`
    ({version: metric}) over `version` (which is one of them)."""
    if how == "last":
        return any(v > version for v in summaries)
    mine = ranking(summaries[version], version)
    return any(ranking(m, v) > mine for v, m in summaries.items())


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
        self.old = {v for v in present if 0 < v <= horizon}
        """Versions at or below the horizon still in the store."""
        self.waiting = sorted(v for v in self.old
                              if wanted(v, cfg.eval.every, cfg.learner.total_steps))
        """Versions past the horizon kept for evaluation or promotion (after a restart: the
        ones evaluation wants that earlier runs of the learner kept)."""

    def chain(self, version: int) -> range:
        """The versions a reader of `version` needs: its full snapshot up to itself."""
        return range(full_base(version, self.cfg.learner.publish.full_every), version + 1)

    def collect(self, version: int) -> list[int]:
        """After the commit of `version`: delete what nothing can need any more; the deleted
        versions, in increasing order."""
        old = gc_horizon(version, self.cfg.learner.max_staleness)
        if old > 0:
            self.old.add(old)
            if wanted(old, self.cfg.eval.every, self.cfg.learner.total_steps):
                self.waiting.append(old)
        if self.waiting:
            self._read_summaries()
            how = self.cfg.promote.choose
            self.waiting = [v for v in self.waiting
                            if v not in self.summaries or not outranked(v, self.summaries, how)]
        needed = set(self.chain(old + 1)) if old >= 0 else set()
        for v in self.waiting:
            needed.update(self.chain(v))
        deleted = sorted(self.old - needed)
        for v in deleted:
            self._delete(v)
            self.old.discard(v)
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
