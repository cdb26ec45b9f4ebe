"""Sample accounting of a run: generated = consumed + stale_dropped + filtered + quarantined
+ unconsumed, each side counted from its own records."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from ..store import NotFound, RunKeys, Store
from ..store.keys import parse_shard_key
from ..store.records import Progress, committed_deltas
from ..store.shards import shards_by_name


@dataclass
class Accounting:
    generated: int = 0
    consumed: int = 0
    stale_dropped: int = 0
    filtered: int = 0
    quarantined: int = 0
    unconsumed: int = 0
    duplicate_shards: list[str] = field(default_factory=list)
    unreadable_quarantined_shards: int = 0
    unreadable_shards: list[str] = field(default_factory=list)
    """Generated shards, not quarantined, that cannot be read as Parquet: rows nobody can
    count, so the balance cannot be said to hold."""

    @property
    def balanced(self) -> bool:
        rhs = self.consumed + self.stale_dropped + self.filtered + self.quarantined + self.unconsumed
        return self.generated == rhs and not self.duplicate_shards and not self.unreadable_shards

    def as_dict(self) -> dict:
        return asdict(self) | {"balanced": self.balanced}

    def line(self) -> str:
        return (f"generated {self.generated} = consumed {self.consumed} + stale_dropped "
                f"{self.stale_dropped} + filtered {self.filtered} + quarantined "
                f"{self.quarantined} + unconsumed {self.unconsumed}"
                f"  [{'holds' if self.balanced else 'DOES NOT HOLD'}]"
                + (f" ({len(self.unreadable_shards)} generated shard(s) unreadable, e.g. "
                   f"{self.unreadable_shards[0]})" if self.unreadable_shards else ""))


def _rows(store: Store, key: str) -> int | None:
    """Rows of the Parquet shard at `key`; None if it is not readable as Parquet, or gone
    (moved to quarantine since the listing). A store that fails raises: a shard the store
    cannot serve now is not a shard with no rows."""
    try:
        data = store.get_bytes(key)
    except NotFound:
        return None
    try:
        return pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
    except (pa.ArrowException, ValueError, OSError):
        return None


def account(store: Store, keys: RunKeys) -> Accounting:
    acc = Accounting()
    # every generated shard: its rollout shard, or its ready shard alone (inline_shards)
    generated = shards_by_name(store, keys, ("rollouts", "ready"))
    found = {name: _rows(store, key) for name, key in generated.items()}
    rows = {name: n or 0 for name, n in found.items()}
    # the ledger: every shard the learner committed, exactly once; the counts of the same
    # commits (a delta written just before the learner stopped, without its progress.json,
    # is not committed: its shards count as unconsumed)
    progress = Progress.read(store, keys.progress())
    seen: set[str] = set()
    for delta in committed_deltas(store, keys.ledger_prefix(), progress.commits):
        for entry in delta.shards:
            name = parse_shard_key(entry.key).name
            if name in seen:
                acc.duplicate_shards.append(name)
            seen.add(name)
            if entry.outcome == "stale":
                acc.stale_dropped += entry.rows
    counts = progress.counts
    acc.consumed = int(counts.get("consumed", 0))
    acc.filtered = int(counts.get("filtered", 0))
    # quarantine: a shard whose name is still generated (a scored or ready shard moved away
    # by prepare or the learner) counts that shard's rows; one that was moved away with no
    # other shard of its name left (a rollout shard by score, an inline worker's only ready
    # shard by the learner) counts its own rows, which were generated too
    quarantined: set[str] = set()
    for key in store.list(keys.quarantine_prefix()):
        try:
            name = parse_shard_key(keys.unquarantined(key)[1]).name
        except ValueError:  # not a shard (an error note, a prompt record)
            continue
        quarantined.add(name)
        if name in rows:
            acc.quarantined += rows[name]
            continue
        n = _rows(store, key)
        acc.unreadable_quarantined_shards += n is None
        acc.generated += n or 0
        acc.quarantined += n or 0
    acc.generated += sum(rows.values())
    acc.unreadable_shards = sorted(generated[name] for name, n in found.items()
                                   if n is None and name not in quarantined
                                   and store.exists(generated[name]))
    acc.unconsumed = sum(n for name, n in rows.items() if name not in seen and name not in quarantined)
    return acc
