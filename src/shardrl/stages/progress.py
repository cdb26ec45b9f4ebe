"""The learner's published progress: what the other stages read to pace themselves."""

from __future__ import annotations

from ..store import RunKeys, Store

PROGRESS = "progress.json"


def progress_key(keys: RunKeys) -> str:
    return keys.state("learn", PROGRESS)


def read_progress(store: Store, keys: RunKeys) -> dict:
    """{version, counts, processed_by_worker: {"0": shards}, groups_by_worker: {"0": prompt
    groups}, kept_groups_by_worker, beta, ...}; empty before the first commit."""
    key = progress_key(keys)
    return store.get_json(key) if store.exists(key) else {}


def shards_per_step(batch_prompts: int, prompts_per_shard: int, workers: int) -> int:
    """Rollout shards each worker must produce for one learner step."""
    shards = -(-batch_prompts // prompts_per_shard)
    return -(-shards // workers)
