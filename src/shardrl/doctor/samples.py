"""`shardrl samples RUN [--version N] [--worst|--best|--random] [-n K]`: a table of generated
samples (prompt, response, reward, length) for the human review reward hacking calls for.

Samples come from the ready shards of the version (they add reward_total and the advantage)
or, when none is ready yet, from its scored shards.
"""

from __future__ import annotations

import sys
from typing import Literal

import numpy as np
import pyarrow as pa

from ..store import RunKeys, Store, parse_shard_key, read_shard, shards_by_name
from ..store.schemas import READY, SCORED
from .series import no_run, open_run

Order = Literal["stored", "worst", "best", "random"]
COLUMNS = ("version", "reward", "ok", "len", "finish", "prompt", "response")
"""Besides: `advantage` (ready shards) and `turns` (multi-turn episodes, whose response is
every turn and the environment's replies between them)."""


def versions_with_data(store: Store, keys: RunKeys) -> list[int]:
    """Policy versions that have scored shards (or ready ones, which hold their columns),
    ascending."""
    return sorted({parse_shard_key(k).version
                   for k in shards_by_name(store, keys, ("scored", "ready")).values()})


def load_samples(store: Store, keys: RunKeys, version: int) -> pa.Table | None:
    """All ready shards of `version` (else its scored shards) as one table; None if none."""
    for kind, schema in (("ready", READY), ("scored", SCORED)):
        shard_keys = [k for k in store.list(keys.version_prefix(kind, version))
                      if k.endswith(".parquet")]
        if shard_keys:
            return pa.concat_tables([read_shard(store, k, schema) for k in shard_keys],
                                    promote_options="default")
    return None


def select(table: pa.Table, order: Order, n: int, seed: int | None = None) -> list[dict]:
    """`n` rows of `table` as dicts: lowest reward first ('worst'), highest ('best'), a random
    draw ('random'), or in stored order; ties keep the stored order."""
    rewards = np.asarray(table.column("reward_rm").to_pylist(), dtype=np.float64)
    if order == "worst":
        idx = np.argsort(rewards, kind="stable")
    elif order == "best":
        idx = np.argsort(-rewards, kind="stable")
    elif order == "random":
        idx = np.random.default_rng(seed).permutation(len(rewards))
    else:
        idx = np.arange(len(rewards))
    rows = table.take(pa.array(idx[:max(n, 0)], pa.int64())).to_pylist()
    return [{"version": r["policy_version"], "reward": r["reward_rm"], "ok": r["correct"],
             "len": len(r["response_token_ids"]), "finish": r["finish_reason"],
             "prompt": r["prompt_text"], "response": r["response_text"],
             **({"advantage": r["advantage"]} if "advantage" in r else {}),
             **({"turns": len(r["turn_starts"])} if "turn_starts" in r else {})} for r in rows]


def _cell(value, width: int) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text if len(text) <= width else text[: width - 1] + "~"


def format_table(rows: list[dict], text_width: int = 48) -> str:
    """Rows as a fixed-width text table; prompt and response cut to `text_width` characters."""
    if not rows:
        return "(no samples)"
    cols = [c for c in (*COLUMNS[:5], "turns", "advantage", *COLUMNS[5:]) if c in rows[0]]
    limit = {"prompt": text_width, "response": text_width}
    cells = [[_cell(r[c], limit.get(c, 12)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    return "\n".join(line.rstrip() for line in lines + [fmt.format(*row) for row in cells])


def run(args) -> int:
    handle = open_run(args.run, args.store)
    if handle is None:
        print(no_run("samples", args.run, args.store), file=sys.stderr)
        return 2
    versions = versions_with_data(handle.store, handle.keys)
    version = args.version if args.version is not None else (versions[-1] if versions else None)
    table = None if version is None else load_samples(handle.store, handle.keys, version)
    if table is None:
        print(f"shardrl samples: run {args.run!r} has no scored samples"
              + (f" for version {version}" if version is not None else ""), file=sys.stderr)
        return 1
    order: Order = ("worst" if args.worst else "best" if args.best else
                    "random" if args.random else "stored")
    rows = select(table, order, args.n)
    print(f"run {args.run}, policy version {version}: {len(rows)} of {len(table)} samples "
          f"({order})")
    print(format_table(rows))
    return 0
