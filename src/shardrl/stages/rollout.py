"""rollout: sample groups of G responses from the newest policy into rollout shards."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from ..store import RunKeys, Store
from ..store.schemas import ROLLOUT
from ..store.shards import write_shard
from ..tasks.source import make_task
from .context import StageContext
from .engine import PolicyEngine
from .progress import buffered_shards, read_progress, shards_per_step

MAX_EMPTY_SHARDS = 20
"""Rollout shards in a row whose every prompt was too long before the stage gives up."""


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    rc = cfg.rollout
    task = make_task(cfg)
    state_key = keys.state("rollout", f"w{ctx.worker:02d}.json")
    state = store.get_json(state_key) if store.exists(state_key) else {"next_seq": 0}
    per_step = shards_per_step(cfg.learner.batch_prompts, rc.prompts_per_shard, ctx.workers)
    # synchronous training (k=0) must not run ahead of the learner by more than one step
    backlog_cap = min(rc.max_backlog_shards, (cfg.learner.max_staleness + 1) * per_step)
    engine = PolicyEngine(ctx, _wait_for_policy(ctx))
    written, paused, skipped = 0, False, 0
    # store writes run in order on one thread, overlapping the next shard's generation; a
    # shard is written only after its sequence number's reservation is stored
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-store")
    last: Future | None = None
    while not ctx.done():
        if ctx.once and written >= per_step:
            break
        waiting = backlog(store, keys, ctx.worker, state["next_seq"])
        if not ctx.once and waiting >= backlog_cap:
            if not paused:
                ctx.log.info("backlog of %d shards: pausing", waiting)
                paused = True
            time.sleep(rc.poll_interval_s)
            continue
        paused = False
        engine.ensure(ctx.latest_version())
        seq = state["next_seq"]
        # reserve the sequence number first: a crash leaves a gap, never two shards with one name
        state = {"next_seq": seq + 1, "version": engine.version}
        reserved = writer.submit(store.put_json, state_key, state)
        items = _fitting(ctx, engine, _prompts(ctx, task, seq), seq)
        if not items:
            skipped += 1
            if skipped >= MAX_EMPTY_SHARDS:
                raise RuntimeError(
                    f"{skipped} rollout shards in a row had only prompts longer than the context "
                    f"({engine.context} tokens with max_new_tokens {rc.max_new_tokens}): shorten "
                    "the prompts, lower rollout.max_new_tokens or use a model with a longer context")
            continue
        skipped = 0
        started = time.monotonic()
        with ctx.cores.busy():
            prompt_ids = engine.encode([it.prompt for it in items])
            groups = engine.engine.generate(prompt_ids, rc.group_size, temperature=rc.temperature,
                                            top_p=rc.top_p, max_new_tokens=rc.max_new_tokens,
                                            seed=cfg.seed * 1_000_003 + ctx.worker * 100_003 + seq)
        seconds = time.monotonic() - started
        table = _table(ctx, engine, items, prompt_ids, groups, seq)
        if last is not None:
            last.result()  # the previous shard is stored (or its error surfaces here)
        last = writer.submit(_write_reserved, reserved, store,
                             keys.rollout(engine.version, ctx.worker, seq), table)
        written += 1
        _log_metrics(ctx, engine.version, table, seconds)
    writer.shutdown()  # waits for the writes still queued
    if last is not None:
        last.result()
    return 0


def _write_reserved(reserved: Future, store: Store, key: str, table: pa.Table) -> None:
    """Write a rollout shard once its reservation is stored; a failed reservation raises."""
    reserved.result()
    write_shard(store, key, table, ROLLOUT)


def backlog(store: Store, keys: RunKeys, worker: int, next_seq: int) -> int:
    """Shards `worker` has reserved (its next sequence number) that the learner has neither
    committed (`progress.json`) nor buffered (`buffered.json`): two small objects, read
    before each shard, whose size does not grow with the run."""
    progress = read_progress(store, keys)
    processed = int(progress.get("processed_by_worker", {}).get(str(worker), 0))
    return next_seq - processed - buffered_shards(store, keys, worker)


def _fitting(ctx: StageContext, engine: PolicyEngine, items: list, seq: int) -> list:
    """The items whose prompt leaves room for max_new_tokens in the model's context; the
    others are recorded under quarantine/rollout/prompts/ with the reason."""
    budget = ctx.cfg.rollout.max_new_tokens
    if engine.context is None:
        return items
    lengths = [len(ids) for ids in engine.encode([it.prompt for it in items])]
    fits = [n + budget <= engine.context for n in lengths]
    if all(fits):
        return items
    too_long = [{"prompt_id": it.prompt_id, "prompt_tokens": n}
                for it, n, ok in zip(items, lengths, fits, strict=True) if not ok]
    key = ctx.keys.quarantine("rollout", ctx.keys.root + f"prompts/w{ctx.worker:02d}-{seq:06d}.json")
    ctx.store.put_json(key, {
        "reason": "prompt_too_long", "context": engine.context, "max_new_tokens": budget,
        "message": f"prompt tokens + max_new_tokens {budget} exceed the model's context of "
                   f"{engine.context} tokens", "prompts": too_long, "time": time.time()})
    ctx.log.warning("%d prompt(s) longer than the context skipped: %s", len(too_long), key)
    return [it for it, ok in zip(items, fits, strict=True) if ok]


def _wait_for_policy(ctx: StageContext) -> int:
    while (version := ctx.latest_version()) is None:
        time.sleep(ctx.cfg.rollout.poll_interval_s)
    return version


def _prompts(ctx: StageContext, task, seq: int):
    n = ctx.cfg.rollout.prompts_per_shard
    npr = ctx.cfg.algo.filters.no_positive_resampling
    if not npr.enabled:
        return task.train_items(ctx.worker, seq, n)
    key = ctx.keys.state("prepare", "retired.json")
    retired = set(ctx.store.get_json(key)["prompt_ids"]) if ctx.store.exists(key) else set()
    fresh = [it for it in task.train_items(ctx.worker, seq, 4 * n) if it.prompt_id not in retired]
    return fresh[:n] or task.train_items(ctx.worker, seq, n)


def _table(ctx: StageContext, engine: PolicyEngine, items, prompt_ids: list[list[int]], groups,
           seq: int) -> pa.Table:
    cols: dict[str, list] = {name: [] for name in ROLLOUT.names}
    now = time.time()
    for i, (item, ids, samples) in enumerate(zip(items, prompt_ids, groups, strict=True)):
        group_id = f"w{ctx.worker:02d}-{seq:06d}-{i:03d}"
        for j, s in enumerate(samples):
            cols["prompt_id"].append(item.prompt_id)
            cols["group_id"].append(group_id)
            cols["sample_idx"].append(j)
            cols["policy_version"].append(engine.version)
            cols["worker"].append(ctx.worker)
            cols["prompt_text"].append(item.prompt)
            cols["prompt_token_ids"].append(ids)
            cols["response_token_ids"].append(s.token_ids)
            cols["behavior_logprobs"].append(s.logprobs)
            cols["finish_reason"].append(s.finish_reason)
            cols["response_text"].append(engine.decode(s.token_ids))
            cols["answer"].append(item.answer)
            cols["category"].append(item.category)
            cols["created_at"].append(now)
    return pa.table(cols)


def _log_metrics(ctx: StageContext, version: int, table: pa.Table, seconds: float) -> None:
    lengths = np.array([len(r) for r in table.column("response_token_ids").to_pylist()])
    truncated = np.array(table.column("finish_reason").to_pylist()) == "length"
    latest = ctx.latest_version() or version
    ctx.metrics.log(version, {
        "response_length_mean": float(lengths.mean()),
        "response_length_p50": float(np.percentile(lengths, 50)),
        "response_length_p90": float(np.percentile(lengths, 90)),
        "response_length_max": float(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
        "generate_s": seconds,
        "version_lag": float(latest - version),
        "samples": float(len(lengths)),
    })
