"""evaluate: held-out pass@1 of policy versions 0, every `eval.every`-th, and the last."""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pyarrow as pa

from ..store.schemas import EVAL
from ..store.shards import write_shard
from ..tasks.source import make_task
from .context import StageContext
from .engine import PolicyEngine

EVAL_SEED = 12_345


def wanted(version: int, every: int, total: int) -> bool:
    return version == 0 or version % every == 0 or version == total


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    task = make_task(cfg)
    while ctx.latest_version() is None:
        time.sleep(cfg.eval.poll_interval_s)
    engine = PolicyEngine(ctx, 0)
    total = cfg.learner.total_steps
    while True:
        finished = ctx.done()
        latest = ctx.latest_version()
        done = set(store.list(keys.root + "eval/"))
        pending = [v for v in range(latest + 1) if wanted(v, cfg.eval.every, total)
                   and keys.eval_summary(v) not in done
                   and store.exists(keys.policy_file(v, "MANIFEST.json"))]
        if pending:
            evaluate_version(ctx, engine, task, pending[0])
            continue
        if (finished and latest >= total) or ctx.once:
            return 0
        time.sleep(cfg.eval.poll_interval_s)


def evaluate_version(ctx: StageContext, engine: PolicyEngine, task, version: int) -> dict:
    cfg = ctx.cfg
    engine.ensure(version)
    items = task.heldout
    n = cfg.eval.samples_per_prompt
    started = time.monotonic()
    with ctx.cores.busy():
        groups = engine.engine.generate(engine.encode([it.prompt for it in items]), n,
                                        temperature=cfg.eval.temperature, top_p=1.0,
                                        max_new_tokens=cfg.eval_max_new_tokens, seed=EVAL_SEED)
    cols: dict[str, list] = {name: [] for name in EVAL.names}
    for item, samples in zip(items, groups, strict=True):
        for j, s in enumerate(samples):
            text = engine.decode(s.token_ids)
            reward = float(task.verify(text, item.answer))
            cols["policy_version"].append(version)
            cols["prompt_id"].append(item.prompt_id)
            cols["category"].append(item.category)
            cols["sample_idx"].append(j)
            cols["prompt_text"].append(item.prompt)
            cols["response_text"].append(text)
            cols["answer"].append(item.answer)
            cols["reward"].append(reward)
            cols["correct"].append(reward >= 1.0)
            cols["response_length"].append(len(s.token_ids))
            cols["finish_reason"].append(s.finish_reason)
    table = pa.table(cols)
    write_shard(ctx.store, ctx.keys.eval_table(version), table, EVAL)
    summary = summarize(table)
    summary.update(version=version, prompts=len(items), samples_per_prompt=n,
                   temperature=cfg.eval.temperature, seconds=time.monotonic() - started)
    ctx.store.put_json(ctx.keys.eval_summary(version), summary)
    ctx.metrics.log(version, {f"evaluate/{k}": v for k, v in summary.items()
                              if isinstance(v, float) and k not in ("seconds", "temperature")})
    ctx.log.info("v%d pass@1 %.3f mean_length %.1f", version, summary["pass_at_1"],
                 summary["mean_length"])
    return summary


def summarize(table: pa.Table) -> dict:
    correct = np.asarray(table.column("correct").to_pylist(), dtype=np.float64)
    out = {
        "pass_at_1": float(correct.mean()),
        "mean_reward": float(np.mean(table.column("reward").to_numpy())),
        "mean_length": float(np.mean(table.column("response_length").to_numpy())),
    }
    by_cat: dict[str, list[float]] = defaultdict(list)
    for cat, ok in zip(table.column("category").to_pylist(), correct, strict=True):
        by_cat[cat].append(ok)
    for cat, values in sorted(by_cat.items()):
        out[f"pass_at_1/{cat}"] = float(np.mean(values))
    return out
