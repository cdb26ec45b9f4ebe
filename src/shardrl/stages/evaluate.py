"""evaluate: held-out pass@1 of policy versions 0, every `eval.every`-th, and the last.

Versions are evaluated in increasing order, so what is owed is one cursor: the lowest wanted
version not evaluated yet (`Schedule`); as they are published, or with `eval.when: after`
once the learner has finished. With the HF engine the snapshot stage evaluates
version 0 itself before it publishes it (`evaluate_snapshot`), so the RL phase starts with
every core free for the first shards and steps; the stage then loads a policy only when a
later version is due. A poll costs the same late in a run as at its start:
`eval/` is listed once when the stage starts, never per poll. After each summary,
`state/evaluate/latest.json` names the newest evaluated version, for the runner's progress line.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..store import RunKeys, Store
from ..store.keys import parse_eval_summary_key
from ..store.records import Done, EvalPointer
from ..store.schemas import EVAL
from ..store.shards import write_shard
from .context import StageContext

if TYPE_CHECKING:
    from .engine import PolicyEngine

EVAL_SEED = 12_345
CONFIRM_SEED = EVAL_SEED + 2**30
"""Sampling seed of the confirming evaluation: draws independent of the ones the choice
was made on (far from `EVAL_SEED` too, for an engine that would seed sample j of prompt i
with `seed + i * n + j`)."""
NOT_FIGURES = ("seconds", "temperature", "published", "evaluated")
"""A summary's numbers that are not the evaluation's figures: its timing and settings."""


def wanted(version: int, every: int, total: int) -> bool:
    return version == 0 or version % every == 0 or version == total


def next_wanted(version: int, every: int, total: int) -> int | None:
    """The first version after `version` to evaluate (the next multiple of `every`, or
    `total`); None once `version >= total`."""
    if version >= total:
        return None
    return min((version // every + 1) * every, total)


def latest_evaluated(store: Store, keys: RunKeys) -> int | None:
    """The newest evaluated version, None before the first evaluation."""
    pointer = EvalPointer.read(store, keys.eval_latest(), optional=True)
    return pointer.version if pointer is not None else None


def summaries(store: Store, keys: RunKeys, read: bool = True) -> dict[int, dict | None]:
    """{version: evaluation summary} of every evaluated version (one listing of `eval/`);
    the summaries are None with `read=False`."""
    return {parse_eval_summary_key(k): store.get_json(k) if read else None
            for k in store.list(keys.root + "eval/") if k.endswith(".json")}


class Schedule:
    """The versions evaluate owes, lowest first, from one listing of `eval/` at start."""

    def __init__(self, store: Store, keys: RunKeys, every: int, total: int) -> None:
        self.every, self.total = every, total
        self.done = set(summaries(store, keys, read=False))
        """Evaluated versions `next` has not reached yet."""
        self.next: int | None = 0
        self._skip_done()

    def due(self, latest: int) -> int | None:
        """The version to evaluate now: the lowest owed one, if published (`<= latest`)."""
        return self.next if self.next is not None and self.next <= latest else None

    def advance(self) -> None:
        """`due`'s version is evaluated (or cannot be): move to the next owed one."""
        if self.next is not None:
            self.done.add(self.next)
            self._skip_done()

    def end_at(self, final: int) -> None:
        """The learner finished at version `final` before `total` (it converged): `final` is
        the last version owed."""
        if final >= self.total:
            return
        self.total = final
        if self.next is not None and self.next > final:
            # every wanted version below `next` is evaluated, `final` among them if it was
            # wanted before it became the last (version 0 or a multiple of `every`)
            self.next = None if final == 0 or final % self.every == 0 else final
        self._skip_done()

    def _skip_done(self) -> None:
        while self.next is not None and self.next in self.done:
            self.done.discard(self.next)
            self.next = next_wanted(self.next, self.every, self.total)


def main(ctx: StageContext, confirm: bool = True) -> int:
    """The evaluate stage; `confirm`: end with `confirm_choice` (replay, whose runs are not
    promoted, passes False)."""
    from ..tasks.source import make_task
    from .engine import PolicyEngine
    from .policy import MANIFEST

    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    task = make_task(cfg)
    ctx.wait_for_run()
    ctx.wait_for_policy(cfg.eval.poll_interval_s)
    engine: PolicyEngine | None = None  # built for the first version due
    total = cfg.learner.total_steps
    schedule = Schedule(store, keys, cfg.eval.every, total)
    ended = False  # DONE.json read: the schedule ends at its version
    after = cfg.eval.when == "after"
    if after:
        ctx.log.info("evaluating once the learner has finished (eval.when: after)")
    while True:
        finished = ctx.done()
        if ctx.aborted() is not None:  # owes nothing, whatever is due: promote refuses the run
            return 0
        if finished and not ended:  # a converged learner stops before `total`
            done = Done.read(store, keys.done(), optional=True)
            if done is not None:
                schedule.end_at(done.steps)
                ended = True
        latest = ctx.latest_version()
        # after: only once DONE.json is read
        version = schedule.due(latest) if ended or not after else None
        if version is not None:
            if store.exists(keys.policy_file(version, MANIFEST)):
                engine = engine or PolicyEngine(ctx, version)
                evaluate_version(ctx, engine, task, version)
            else:  # published versions that evaluation wants are never collected
                ctx.log.error("policy v%d is gone from the store: not evaluated", version)
            schedule.advance()
            continue
        if finished and latest >= schedule.total:
            if confirm:
                confirm_choice(ctx, engine, task)
            return 0
        if ctx.once:
            return 0
        time.sleep(cfg.eval.poll_interval_s)


def confirm_choice(ctx: StageContext, engine: PolicyEngine | None, task) -> dict | None:
    """Evaluate the version promote will choose once more, on fresh samples.

    The choice is the best of several evaluations on the same held-out items, so the chosen
    version's figure is biased upward: the maximum of noisy estimates (the winner's curse).
    A second evaluation of that version alone, with independent draws, is not; promote
    registers and compares it. Nothing to confirm when promote takes the last version, or
    when sampling is greedy (the same draws again)."""
    from .engine import PolicyEngine
    from .policy import MANIFEST
    from .promote import choose

    cfg, store, keys = ctx.cfg, ctx.store, ctx.keys
    if cfg.promote.choose != "best" or cfg.eval.temperature == 0:
        return None
    evaluated = summaries(store, keys)
    if not evaluated:
        return None
    version = choose(evaluated, cfg.promote.metric, "best")
    known = store.get_json(keys.eval_confirm()) if store.exists(keys.eval_confirm()) else None
    if known is not None and known.get("version") == version:
        return known  # a stage restarted after it
    if not store.exists(keys.policy_file(version, MANIFEST)):
        ctx.log.error("policy v%d is gone from the store: its choice is not confirmed", version)
        return None
    engine = engine or PolicyEngine(ctx, version)
    return evaluate_version(ctx, engine, task, version, confirm=True)


def evaluates_snapshot(cfg) -> bool:
    """Whether the snapshot stage evaluates version 0 (`evaluate_snapshot`): with the HF
    engine, which every image has. A vLLM engine lives in its own image, which the snapshot
    does not run in: then this stage evaluates version 0 as any other."""
    return cfg.rollout.engine == "hf"


def evaluate_snapshot(ctx: StageContext, task) -> dict:
    """Evaluate policy version 0 as this stage would (its engine, threads, sampling seed and
    records, its metrics under `evaluate/`), in the snapshot stage's process once v0 is in
    the store and before it is published. The snapshot's pass@1 is then known when the RL
    phase starts, and the RL phase's first seconds are not shared with it: the stages start
    together then, and the evaluation of v0 (some 125 ms of CPU at the demo's size, against
    about 80 ms for the learner's start-up and first shard reads) delayed the first version
    by 60 ms and the tenth by 115 ms (medians of 14 paired runs on 2 cores)."""
    import torch

    from ..graph import stage
    from .engine import PolicyEngine

    ectx = ctx.as_stage("evaluate", worker=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(stage("evaluate").threads(ctx.cfg))
    try:
        return evaluate_version(ectx, PolicyEngine(ectx, 0), task, 0)
    finally:
        torch.set_num_threads(threads)
        ectx.metrics.flush()


def eval_setup(cfg, items) -> str:
    """Short hash of what an evaluation's figures depend on besides the policy: the held-out
    items themselves, how prompts are formatted, how samples are drawn and scored (the
    task's own verifier; in an environment, the environment, its turns and the sandbox's
    limits). The training reward's settings (shaping, a reward model, overlong penalties)
    are not in it: an evaluation does not use them. Two evaluations compare only when
    theirs agree; `promote` checks it before it moves the champion."""
    episodes = cfg.task.environment is not None
    setup = {
        "items": [[it.prompt_id, it.prompt, it.answer, it.category] for it in items],
        "verifier": [cfg.task.source.kind, getattr(cfg.task.source, "name", None)],
        "prompt_format": cfg.task.prompt_format, "system_prompt": cfg.task.system_prompt,
        "samples_per_prompt": cfg.eval.samples_per_prompt, "temperature": cfg.eval.temperature,
        "max_new_tokens": cfg.eval_max_new_tokens, "seed": EVAL_SEED,
        "environment": cfg.task.environment,
        "max_turns": cfg.rollout.max_turns if episodes else None,
        "sandbox": cfg.reward.sandbox.model_dump(mode="json") if episodes else None,
    }
    blob = json.dumps(setup, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def evaluate_version(ctx: StageContext, engine: PolicyEngine, task, version: int,
                     confirm: bool = False) -> dict:
    """Evaluate `version` on the held-out items; its table, metrics and summary stored. With
    `confirm`, on fresh draws (`CONFIRM_SEED`), stored as `eval_confirm` and logged under
    `evaluate/confirmed/`: the version's own evaluation stays as it was."""
    cfg = ctx.cfg
    engine.ensure(version)
    items = task.heldout
    n = cfg.eval.samples_per_prompt
    started = time.monotonic()
    from .episodes import episode_runner

    sampling = dict(temperature=cfg.eval.temperature, top_p=1.0,
                    max_new_tokens=cfg.eval_max_new_tokens,
                    seed=CONFIRM_SEED if confirm else EVAL_SEED)
    episodes = episode_runner(ctx, engine)  # multi-turn: the environment's return is the reward
    with ctx.cores.busy():
        prompt_ids = engine.encode([it.prompt for it in items])
        _check_fit(ctx, engine, items, prompt_ids)
        groups = (engine.engine.generate(prompt_ids, n, **sampling) if episodes is None
                  else episodes.run(items, prompt_ids, n, **sampling))
    cols: dict[str, list] = {name: [] for name in EVAL.names}
    texts = iter(engine.decode_all([s.token_ids for samples in groups for s in samples]))
    for item, samples in zip(items, groups, strict=True):
        for j, s in enumerate(samples):
            text = next(texts)
            reward = (float(task.verify(text, item.answer)) if episodes is None
                      else s.episode_return)
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
    write_shard(ctx.store, ctx.keys.eval_confirm("parquet") if confirm
                else ctx.keys.eval_table(version), table, EVAL)
    summary = summarize(table)
    from .policy import MANIFEST

    # when the version was published: its weights may be deleted once promotion cannot
    # choose it, this time stays with the evaluation (for curves against the clock)
    published = ctx.store.get_json(ctx.keys.policy_file(version, MANIFEST))["time"]
    summary.update(version=version, prompts=len(items), samples_per_prompt=n,
                   temperature=cfg.eval.temperature, seconds=time.monotonic() - started,
                   published=published, evaluated=time.time(), setup=eval_setup(cfg, items))
    prefix = "evaluate/confirmed/" if confirm else "evaluate/"
    # the metrics are stored before the summary, which marks the version evaluated: a stage
    # stopped in between evaluates it again (the same points), never leaves them unlogged
    ctx.metrics.log(version, {f"{prefix}{k}": v for k, v in summary.items()
                              if isinstance(v, float) and k not in NOT_FIGURES})
    ctx.metrics.flush()
    if confirm:
        summary["seed"] = CONFIRM_SEED
        ctx.store.put_json(ctx.keys.eval_confirm(), summary)
        ctx.log.info("v%d pass@1 %.3f%s on fresh samples (the version promote chooses, "
                     "confirmed)", version, summary["pass_at_1"], plus_minus(summary, "pass_at_1"))
        return summary
    ctx.store.put_json(ctx.keys.eval_summary(version), summary)
    EvalPointer(version=version).write(ctx.store, ctx.keys.eval_latest())
    ctx.log.info("v%d pass@1 %.3f%s mean_length %.1f", version, summary["pass_at_1"],
                 plus_minus(summary, "pass_at_1"), summary["mean_length"])
    return summary


def standard_error(values: np.ndarray, prompts: list[str]) -> float | None:
    """Standard error of the mean of `values` over held-out prompts: the samples of one
    prompt are not independent draws (a prompt the policy solves it solves in most of its
    samples), so it is the spread of the prompts' own means, std / sqrt(prompts), with the
    prompts weighed by their samples as the mean is. With one sample a prompt it is the
    binomial error sqrt(p (1 - p) / (n - 1)); None with fewer than two prompts."""
    groups: dict[str, list[float]] = defaultdict(list)
    for prompt, value in zip(prompts, values, strict=True):
        groups[prompt].append(float(value))
    if len(groups) < 2:
        return None
    means = np.array([np.mean(v) for v in groups.values()])
    sizes = np.array([len(v) for v in groups.values()], dtype=np.float64)
    weights = sizes / sizes.sum()
    mean = float(weights @ means)
    k = len(groups)
    # the ratio estimator's variance, with k / (k - 1) for the mean estimated from the data
    return float(np.sqrt(k / (k - 1) * np.sum(weights ** 2 * (means - mean) ** 2)))


def _check_fit(ctx: StageContext, engine: PolicyEngine, items, prompt_ids: list[list[int]],
               shown: int = 5) -> None:
    """Refuse held-out prompts that have no token or leave no room for the evaluation's
    `max_new_tokens` in the model's context (an episode's first turn takes the room there
    is, so in an environment a prompt needs room for one token). Rollout skips such prompts
    and records them; an evaluation cannot: a pass@1 over fewer items is not the figure its
    setup hash names, and a model sampled past its context scores what it was never trained
    to produce. So the stage stops as it does on an invalid config, before it samples (with
    the HF engine that is the snapshot stage's evaluation of version 0, before the RL phase
    starts)."""
    budget, context = ctx.cfg.eval_max_new_tokens, engine.context
    room = 1 if ctx.cfg.task.environment is not None else budget
    unfit = [(it.prompt_id, len(ids)) for it, ids in zip(items, prompt_ids, strict=True)
             if not engine.fits(len(ids), room)]
    if not unfit:
        return
    from ..config import ConfigError, FieldError

    listed = ", ".join(f"{pid} ({n} tokens)" for pid, n in unfit[:shown])
    more = f" and {len(unfit) - shown} more" if len(unfit) > shown else ""
    field = "eval.max_new_tokens" if ctx.cfg.eval.max_new_tokens else "rollout.max_new_tokens"
    raise ConfigError("the run's config", [FieldError(field, (
        f"{len(unfit)} of {len(items)} held-out prompt(s) are empty or leave no room for "
        f"{room} new token(s) in the model's context of {context} tokens: {listed}{more}; "
        "shorten those prompts, lower the evaluation's max_new_tokens or use a model with a "
        "longer context"))])


def plus_minus(summary: dict, metric: str) -> str:
    """` ± SE` of a summary's `metric`, or nothing when the summary has none."""
    se = summary.get(f"{metric}_se")
    return "" if se is None else f" ± {se:.3f}"


def summarize(table: pa.Table) -> dict:
    """An evaluation's figures: pass@1, mean reward and length, pass@1 per category, and the
    standard errors of pass@1 and mean reward (`standard_error`)."""
    correct = np.asarray(table.column("correct").to_pylist(), dtype=np.float64)
    reward = np.asarray(table.column("reward").to_numpy(), dtype=np.float64)
    prompts = table.column("prompt_id").to_pylist()
    out = {
        "pass_at_1": float(correct.mean()),
        "mean_reward": float(reward.mean()),
        "mean_length": float(np.mean(table.column("response_length").to_numpy())),
    }
    for name, values in (("pass_at_1", correct), ("mean_reward", reward)):
        se = standard_error(values, prompts)
        if se is not None:
            out[f"{name}_se"] = se
    by_cat: dict[str, list[float]] = defaultdict(list)
    for cat, ok in zip(table.column("category").to_pylist(), correct, strict=True):
        by_cat[cat].append(ok)
    for cat, values in sorted(by_cat.items()):
        out[f"pass_at_1/{cat}"] = float(np.mean(values))
    return out
