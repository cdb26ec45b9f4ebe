"""A fair synchronous baseline: ShardRL's own math in one process, without the object store.

The loop is generate -> verify -> group advantages and filtering -> one policy update,
strictly in turn, on one model in memory, with every core (`torch.set_num_threads(
os.cpu_count())`; `--threads` sets another count: on a small model, or on cores other work
is using, fewer threads can be faster) and, as the local runner gives every ShardRL stage,
`OMP_WAIT_POLICY=PASSIVE` unless the environment sets it (`passive_openmp`). Each piece is the library's, called as the pipeline's stages call it:

- generate: `HFEngine.generate` on the training prompt stream of rollout worker 0
  (`task.train_items(0, seq, rollout.prompts_per_shard)`, shard `seq` by shard), with the
  rollout's group size, temperature, top-p and response length; prompts too long for the
  model's context are skipped as the rollout stage skips them. Each call samples as many
  shards as the kept groups the step still lacks need at the keep rate seen so far (one
  shard's worth at first), so a step is mostly one batched call: one larger batch samples
  faster per sample than several small ones, as the rollout workers' batches do.
- verify: the score stage's reward (`build_reward`: the configured verifiers).
- prepare: per shard, as the prepare stage does, `shape_rewards` (with the running reward
  moments when `algo.shaping.normalize`), the `group` advantage estimator with the
  normalisation prepare applies per shard (`shard_norm`; the batch std is the learner's),
  `zero_variance_keep`, non-finite rows dropped,
  and No-Positive-Resampling's pass-rate history when it is on.
- update: exactly when the learner would step, i.e. once the shards since the last step hold
  `learner.batch_prompts` prompt groups kept by filtering (more shards are generated until
  they do, or until `FILTERED_LIMIT` batches' worth of groups are in); `update_loss` of the
  update stage on the kept rows (split into micro-batches as the learner splits them), then the torch learner backend's AdamW (the config's lr,
  betas, weight decay and gradient clip) at `lr x lr_schedule(version)` (warmup and decay).

What it does not cover (it raises): KL terms (a reference model), GAE (a critic), LoRA and
the vLLM engine. The policy trains as the learner's does, with activation checkpointing when
`learner.activation_checkpointing` turns it on (whole rows then, no shared prompts). The
baseline is on-policy (every sample is from the current weights).

Its clock starts once torch, transformers and the library are imported, their first-call
costs paid and the task built, as ShardRL's runner does before its stages start
(`before_clock`) and the snapshot's model and tokenizer are loaded (`load_snapshot`), as
ShardRL's stages load policy v0 while its snapshot stage still evaluates it; `--clock-start`,
epoch seconds, sets another start. Everything after counts (the engine, the optimizer, the
first step), as ShardRL's stage start-up after its snapshot does)
and is paused while held-out pass@1 is measured: `bench.demo_control.heldout_pass`, the
function, engine and sampling seed the TRL side is evaluated with, on all held-out prompts;
at t=0 (the snapshot), every `budget / eval_points` seconds of clock, and when the budget is
spent. With `--eval-after` (what `bench.trl_bench` asks for when ShardRL evaluates after its
training, `eval.when: after`) the loop only copies its weights at those points, its clock
paused, and evaluates the copies once the budget is spent, as ShardRL's evaluate stage
evaluates its published versions: dense evaluations then do not run between the loop's steps,
where each would leave its caches and heap to the next step. Copies that would take more
than `EVAL_AFTER_MAX_BYTES` are evaluated in place instead (`eval_when` in the result says
which). Its samples are every generated sample, filtered ones included (ShardRL's accounting).

    .venv/bin/python -m bench.sync_baseline --snapshot DIR --budget 90 --out sync.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from bench.curves import steady_samples_per_s

EVAL_AFTER_MAX_BYTES = 2 << 30
"""Most memory the weight copies of `--eval-after` may take (all points together)."""


def passive_openmp() -> None:
    """Idle OpenMP threads sleep rather than spin (`OMP_WAIT_POLICY=PASSIVE`, unless the
    environment chooses), as the local runner sets for every ShardRL stage: spinning threads
    take cores other processes need, which made a 2-thread baseline step many times slower on
    a busy 2-core machine. Takes effect only before torch is imported."""
    os.environ["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"


class PausableClock:
    """Seconds since `start` (epoch seconds), less the time spent in `paused`."""

    def __init__(self, start: float) -> None:
        self.start, self.paused_s = start, 0.0

    def now(self) -> float:
        return time.time() - self.start - self.paused_s

    def paused(self, fn, *args):
        """`fn(*args)` with the clock stopped."""
        t0 = time.time()
        try:
            return fn(*args)
        finally:
            self.paused_s += time.time() - t0


def check_supported(cfg) -> None:
    """Raise for what this baseline does not reproduce (see the module docstring)."""
    algo = cfg.algo
    problems = []
    if algo.kl.placement != "none":
        problems.append("algo.kl.placement must be 'none' (no reference model here)")
    if algo.advantages.estimator != "group" or algo.critic is not None:
        problems.append("algo.advantages.estimator must be 'group' without a critic")
    if cfg.rollout.engine != "hf":
        problems.append("rollout.engine must be 'hf'")
    if cfg.learner.backend.kind != "torch":
        problems.append("learner.backend.kind must be 'torch' (one process)")
    if cfg.learner.lora is not None:
        problems.append("learner.lora must be unset (full fine-tuning)")
    if problems:
        raise ValueError("the synchronous baseline does not cover this config: "
                         + "; ".join(problems))


class SyncTrainer:
    """The pieces of one synchronous run, and its counters."""

    def __init__(self, cfg, snapshot: Path, threads: int | None = None,
                 loaded: tuple | None = None) -> None:
        """`loaded`: the snapshot's (model, tokenizer), loaded before the clock started
        (`load_snapshot`); None: loaded here."""
        import torch

        from shardrl.algo import PassRateTracker, RunningMoments
        from shardrl.engines.hf import HFEngine
        from shardrl.learner_backends import build_backend
        from shardrl.stages.update import checkpoint_activations
        from shardrl.tasks.prompts import PromptFormat
        from shardrl.tasks.rewards import build_reward
        from shardrl.tasks.source import make_task

        check_supported(cfg)
        self.threads = threads or os.cpu_count() or 1
        torch.set_num_threads(self.threads)
        self.cfg = cfg
        self.task = make_task(cfg)
        self.model, self.tokenizer = loaded or load_snapshot(snapshot)
        checkpoint_activations(cfg, self.model)  # as the learner trains, if configured
        self.prompt_format = PromptFormat.from_config(cfg)
        self.context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.engine = HFEngine(self.model, eos_token_id=self.tokenizer.eos_token_id,
                               pad_token_id=self.tokenizer.pad_token_id,
                               fp32_lm_head=cfg.model.fp32_lm_head, version=0)
        self.reward = build_reward(cfg, self.task)
        self.backend = build_backend(cfg.learner, self.model)
        npr = cfg.algo.filters.no_positive_resampling
        self.moments = RunningMoments()
        self.tracker = PassRateTracker(window=npr.window, retire_at=npr.retire_at,
                                       min_samples=npr.min_samples)
        self.seq = 0
        """The next shard's sequence number (worker 0's prompt stream)."""
        self.empty = 0
        """Shards in a row without a prompt that fits the context."""
        self.version = 0
        self.counts = {"generated": 0, "consumed": 0, "filtered": 0, "skipped_steps": 0}
        self.groups = self.kept_groups = 0
        """Prompt groups prepared so far, and those kept by filtering: the keep rate that
        sizes each generation call."""
        self.seconds = {"generate": 0.0, "score_prepare": 0.0, "update": 0.0}
        self.cpu_seconds = {"generate": 0.0, "tables": 0.0, "score_prepare": 0.0,
                            "update": 0.0}
        """The process's CPU seconds (every thread's: torch's pool too) in the sampling calls
        (`generate`), in drawing and encoding prompts and building the shards' tables around
        them (`tables`), in scoring and prepare, and in updates."""
        self.step_update_cpu_s: list[float] = []
        self.step_rows: list[int] = []
        """Per applied step, in order (entry i made version i + 1): the CPU seconds of its
        update and the kept rows it trained on."""

    # -- one round of generation ----------------------------------------------------------
    def _prompts(self, seq: int) -> list:
        """The rollout stage's prompts of shard `seq` (worker 0), too-long ones skipped."""
        rc = self.cfg.rollout
        n = rc.prompts_per_shard
        if self.cfg.algo.filters.no_positive_resampling.enabled:
            retired = self.tracker.retired()
            items = [it for it in self.task.train_items(0, seq, 4 * n)
                     if it.prompt_id not in retired][:n] or self.task.train_items(0, seq, n)
        else:
            items = self.task.train_items(0, seq, n)
        if self.context is None:
            return items
        lengths = [len(ids) for ids in self.encode([it.prompt for it in items])]
        return [it for it, n in zip(items, lengths, strict=True)
                if n + rc.max_new_tokens <= self.context]

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids as the rollout stage encodes them (`task.prompt_format`)."""
        return self.prompt_format.encode(self.tokenizer, prompts)

    def generate(self, shards: int, clock: PausableClock,
                 events: list[tuple[float, float]]) -> list:
        """`shards` rollout shards (tables with the ROLLOUT columns) from one batched call."""
        cpu_started, sampled = time.process_time(), self.cpu_seconds["generate"]
        try:
            return self._generate(shards, clock, events)
        finally:  # all but the sampling call: drawing and encoding prompts, building tables
            self.cpu_seconds["tables"] += (time.process_time() - cpu_started
                                           - (self.cpu_seconds["generate"] - sampled))

    def _generate(self, shards: int, clock: PausableClock,
                  events: list[tuple[float, float]]) -> list:
        from shardrl.engines.base import mixed_seed
        from shardrl.stages.engine import decode_all
        from shardrl.stages.rollout import MAX_EMPTY_SHARDS, rollout_table

        rc, cfg = self.cfg.rollout, self.cfg
        per_shard = [(self.seq + s, self._prompts(self.seq + s)) for s in range(shards)]
        self.seq += shards
        for _, its in per_shard:
            self.empty = 0 if its else self.empty + 1
        if self.empty >= MAX_EMPTY_SHARDS:  # as the rollout stage gives up
            raise RuntimeError(f"{self.empty} shards in a row had only prompts longer than "
                               f"the model's context ({self.context} tokens)")
        per_shard = [(seq, items) for seq, items in per_shard if items]
        items = [it for _, its in per_shard for it in its]
        if not items:
            return []
        started = time.monotonic()
        self.model.eval()
        prompt_ids = self.encode([it.prompt for it in items])
        cpu_started = time.process_time()
        groups = self.engine.generate(prompt_ids, rc.group_size, temperature=rc.temperature,
                                      top_p=rc.top_p, max_new_tokens=rc.max_new_tokens,
                                      seed=mixed_seed(cfg.seed, 0, per_shard[0][0]))
        self.cpu_seconds["generate"] += time.process_time() - cpu_started
        self.seconds["generate"] += time.monotonic() - started
        n = sum(len(g) for g in groups)
        self.counts["generated"] += n
        events.append((clock.now(), float(n)))
        tables, at = [], 0
        now = time.time()
        texts = decode_all(self.tokenizer, [s.token_ids for g in groups for s in g])
        for seq, its in per_shard:  # the rollout stage's table, group ids as worker 0's
            shard_groups = groups[at:at + len(its)]
            rows = sum(len(g) for g in shard_groups)
            tables.append(rollout_table(its, prompt_ids[at:at + len(its)], shard_groups,
                                        version=self.version, worker=0, seq=seq,
                                        texts=texts[:rows], created_at=now))
            texts = texts[rows:]
            at += len(its)
        return tables

    # -- score and prepare, as the stages do per shard -------------------------------------
    def score(self, table):
        """The scored shard: the score stage's columns (no reference logprobs)."""
        import pyarrow as pa

        from shardrl.store.schemas import SCORED

        result = self.reward.score_table(table)
        out = table
        for name in ("reward_verifier", "reward_model", "reward_rm", "correct", "reward_error"):
            out = out.append_column(SCORED.field(name),
                                    pa.array(result[name], type=SCORED.field(name).type))
        field = SCORED.field("ref_logprobs")
        return out.append_column(field, pa.array([None] * len(table), type=field.type))

    def prepare(self, table):
        """The ready shard: the prepare stage's advantages, keep flags and reasons."""
        from shardrl.stages.prepare import ready_columns

        out = ready_columns(table, self._shape)
        self.tracker.update(out.column("prompt_id").to_pylist(),
                            out.column("correct").to_pylist())
        return out

    def _shape(self, table):
        """(reward_total, advantage, keep, filter_reason) of the rows with finite numbers:
        the prepare stage's `shape_shard` (no KL term here)."""
        import numpy as np
        import torch

        from shardrl.algo.shaping import normalized_scores
        from shardrl.stages.prepare import shape_shard

        reward_rm = torch.tensor(table.column("reward_rm").to_numpy(), dtype=torch.float32)
        group_ids = torch.from_numpy(
            np.unique(table.column("group_id").to_numpy(zero_copy_only=False),
                      return_inverse=True)[1].astype(np.int64))  # (B,)
        shaping = self.cfg.algo.shaping
        if shaping.normalize:
            self.moments.update(normalized_scores(reward_rm, shaping.clip,
                                                  shaping.clip_before_norm))
        return shape_shard(self.cfg.algo, reward_rm, group_ids, self.moments,
                           torch.zeros_like(reward_rm), 0.0)

    # -- one learner step ------------------------------------------------------------------
    def batch(self, clock: PausableClock, events: list[tuple[float, float]]):
        """Ready shards until `batch_prompts` kept groups (or the filtered limit), in order,
        as the learner's `next_batch` takes them; one table of all their rows."""
        import pyarrow as pa

        from shardrl.stages.staleness import FILTERED_LIMIT

        b, per = self.cfg.learner.batch_prompts, self.cfg.rollout.prompts_per_shard
        ready, kept, total = [], set(), set()
        while len(kept) < b and len(total) < FILTERED_LIMIT * b:
            # the shards the missing kept groups need at the keep rate seen so far (1 before
            # any: then a shard adds at most `per` kept groups and this never overshoots),
            # in one call: one larger batch samples faster than several small ones
            rate = self.kept_groups / self.groups if self.groups else 1.0
            need = min(math.ceil((b - len(kept)) / (per * max(rate, 1.0 / per))),
                       math.ceil((FILTERED_LIMIT * b - len(total)) / per))
            shards = self.generate(need, clock, events)
            started, cpu_started = time.monotonic(), time.process_time()
            for table in shards:
                table = self.prepare(self.score(table))
                ready.append(table)
                ids = table.column("group_id").to_pylist()
                mine = {g for g, k in zip(ids, table.column("keep").to_pylist(), strict=True)
                        if k}
                self.groups += len(set(ids))
                self.kept_groups += len(mine)
                total.update(ids)
                kept.update(mine)
            self.seconds["score_prepare"] += time.monotonic() - started
            self.cpu_seconds["score_prepare"] += time.process_time() - cpu_started
        return pa.concat_tables(ready)

    def update(self, table) -> bool:
        """The learner's update on the kept rows; True when a step was applied."""
        from shardrl.algo import lr_schedule
        from shardrl.stages.update import update_loss

        lc = self.cfg.learner
        kept = table.filter(table.column("keep"))
        self.counts["consumed"] += len(kept)
        self.counts["filtered"] += len(table) - len(kept)
        if not len(kept):  # as the learner: no update, and not counted as a skipped step
            return False
        started, cpu_started = time.monotonic(), time.process_time()
        scale = lr_schedule(self.version, warmup_steps=lc.warmup_steps,
                            total_steps=lc.total_steps, kind=lc.schedule,
                            min_ratio=lc.min_lr_ratio)
        self.backend.set_lr("policy", lc.lr * scale)
        self.model.train()
        loss, _ = update_loss(self.cfg, self.backend.policy, kept, self.tokenizer.pad_token_id,
                              0.0, None, self.cfg.learner.backend.kind)
        applied, _ = self.backend.step(loss)
        self.model.eval()
        self.seconds["update"] += time.monotonic() - started
        cpu = time.process_time() - cpu_started
        self.cpu_seconds["update"] += cpu
        if applied:
            self.step_update_cpu_s.append(cpu)
            self.step_rows.append(len(kept))
            self.version += 1
            self.engine.version = self.version
        else:
            self.counts["skipped_steps"] += 1
        return applied


def before_clock(cfg) -> None:
    """What ShardRL's runner does before its stages' clock starts, done for a peer too
    (`orchestrate.fork.warm`): the stages' modules imported (the baseline uses their
    helpers), the libraries' lazy loads and first-call costs paid on a throwaway model, the
    run's task built (`make_task`, cached for the process) and the objects made so far kept
    out of the collector's full passes."""
    from shardrl.orchestrate.fork import warm

    warm(cfg)


def load_snapshot(snapshot: Path) -> tuple:
    """The snapshot's (model, tokenizer), loaded before a peer's clock starts, as ShardRL's
    rollout workers and learner load policy v0 while the snapshot stage still evaluates it,
    before its clock starts (`StageContext.preload_policy`)."""
    from shardrl.models.io import load_causal_lm, load_tokenizer

    return load_causal_lm(snapshot), load_tokenizer(snapshot)


def weight_copy(model) -> dict:
    """The model's weights, copied (what `--eval-after` keeps at each evaluation point)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_sync(config: str, overrides: list[str], snapshot: Path, budget: float,
             eval_points: int, clock_start: float | None = None,
             threads: int | None = None, eval_after: bool = False) -> dict:
    """Synchronous training from `snapshot` until `budget` seconds of clock (from
    `clock_start`, by default once the libraries are imported and the model loaded;
    evaluations excluded) are spent, on `threads` torch threads (None: one per core); its
    pass@1 curve and sample counts. `eval_after`: the points' weights are copied and
    evaluated after the budget (see the module docstring)."""
    from bench.demo_control import heldout_pass
    from shardrl.config import load_config

    cfg = load_config(config, overrides)
    before_clock(cfg)
    loaded = load_snapshot(snapshot)
    clock = PausableClock(time.time() if clock_start is None else clock_start)
    trainer = SyncTrainer(cfg, snapshot, threads, loaded)

    def evaluate() -> float:
        value = heldout_pass(trainer.model, trainer.tokenizer, cfg, trainer.task)
        trainer.model.eval()
        return value

    weight_bytes = sum(v.numel() * v.element_size() for v in trainer.model.state_dict().values())
    if eval_after and weight_bytes * (eval_points + 1) > EVAL_AFTER_MAX_BYTES:
        print(f"sync baseline: {eval_points + 1} copies of {weight_bytes / 2**20:.0f} MiB of "
              f"weights would pass {EVAL_AFTER_MAX_BYTES / 2**30:.0f} GiB; evaluating in place",
              file=sys.stderr)
        eval_after = False
    copies: list[dict] = []
    """the weights at each point of `curve`, with `eval_after`"""

    def measure():
        if not eval_after:
            return evaluate()
        copies.append(weight_copy(trainer.model))
        return None

    interval = budget / max(eval_points, 1)
    curve = [(0.0, clock.paused(measure))]
    curve_versions = [0]
    """the version each point of `curve` measured"""
    started = clock.now()
    next_eval = interval
    events: list[tuple[float, float]] = []
    """(clock seconds when a generation call ended, samples it generated)"""
    step_times: list[float] = []
    """clock seconds at which each version after the snapshot was made"""
    while True:
        table = trainer.batch(clock, events)
        if trainer.update(table):
            step_times.append(clock.now())
        at = clock.now()
        if at >= budget or at >= next_eval:
            curve.append((at, clock.paused(measure)))
            curve_versions.append(trainer.version)
            while next_eval <= at:
                next_eval += interval
        if at >= budget:
            break
    seconds = curve[-1][0]
    if eval_after:  # the clock has stopped: evaluate each point's weights now
        final = weight_copy(trainer.model)
        for i, state in enumerate(copies):
            trainer.model.load_state_dict(state)
            curve[i] = (curve[i][0], evaluate())
        trainer.model.load_state_dict(final)
    return {"curve": curve, "curve_versions": curve_versions, "step_times": step_times,
            "eval_when": "after" if eval_after else "during",
            "seconds": seconds, "steps": trainer.version,
            "samples": trainer.counts["generated"], **{k: v for k, v in trainer.counts.items()
                                                       if k != "generated"},
            "samples_per_s": trainer.counts["generated"] / seconds,
            "steady_samples_per_s": steady_samples_per_s(step_times, events),
            "startup_seconds": started, "eval_seconds": clock.paused_s,
            "phase_seconds": trainer.seconds, "phase_cpu_seconds": trainer.cpu_seconds,
            "cpu_per_step": cpu_per_step(trainer.cpu_seconds, trainer.version),
            "step_update_cpu_s": trainer.step_update_cpu_s, "step_rows": trainer.step_rows,
            "threads": trainer.threads}


def cpu_per_step(cpu_seconds: dict[str, float], steps: int) -> dict[str, float] | None:
    """The baseline's CPU seconds per optimizer step, in all and by phase (None before a
    step). The phases are all its work on the clock but setting up the trainer (engine,
    optimizer) at the start."""
    if steps <= 0:
        return None
    per = {phase: s / steps for phase, s in cpu_seconds.items()}
    return {"total": sum(per.values()), **per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override")
    parser.add_argument("--snapshot", type=Path, required=True,
                        help="HF folder to start from (a run's policy/v000000/)")
    parser.add_argument("--budget", type=float, required=True, help="seconds of clock")
    parser.add_argument("--eval-points", type=int, default=6)
    parser.add_argument("--clock-start", type=float,
                        help="epoch seconds (default: once the libraries are imported and "
                             "the model loaded)")
    parser.add_argument("--out", type=Path, required=True, help="JSON written here")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: one per core, os.cpu_count())")
    parser.add_argument("--eval-after", action="store_true",
                        help="copy the weights at each evaluation point and evaluate the "
                             "copies after the budget, not between steps")
    args = parser.parse_args()
    passive_openmp()
    result = run_sync(args.config, args.overrides, args.snapshot, args.budget,
                      args.eval_points, args.clock_start, args.threads, args.eval_after)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
