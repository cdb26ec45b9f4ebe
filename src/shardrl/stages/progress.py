"""The learner's published progress: what the other stages read to pace themselves."""

from __future__ import annotations

from ..store import RunKeys, Store

PROGRESS = "progress.json"


def progress_key(keys: RunKeys) -> str:
    return keys.state("learn", PROGRESS)


def read_progress(store: Store, keys: RunKeys) -> dict:
    """{step, version, processed_by_worker: {"0": shards}, beta}; empty before the first step."""
    key = progress_key(keys)
    return store.get_json(key) if store.exists(key) else {}


def shards_per_step(batch_prompts: int, prompts_per_shard: int, workers: int) -> int:
    """Rollout shards each worker must produce for one learner step."""
    shards = -(-batch_prompts // prompts_per_shard)
    return -(-shards // workers)


def buffered_shards(store: Store, keys: RunKeys, worker: int) -> int:
    """Shards of `worker` the learner has read but not yet committed (waiting for a batch)."""
    key = keys.state("learn", "buffered.json")
    return int(store.get_json(key).get(str(worker), 0)) if store.exists(key) else 0
