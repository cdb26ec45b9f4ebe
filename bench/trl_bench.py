"""TRL's GRPOTrainer and ShardRL on the same SFT snapshot, task and wall-clock budget.

One repeat: run the `demo` pipeline (it builds the SFT snapshot, then its RL phase is
ShardRL's curve); then train TRL's `GRPOTrainer` from that snapshot's `policy/v000000/`
folder for as long as ShardRL's RL phase lasted. Both get the same task (the cipher task's
training prompt stream and verifier), group size, prompts per optimizer step, learning rate
and schedule, AdamW betas, gradient clip, sampling temperature and response length, all read
from the one run config. Held-out pass@1 is measured the same way for both (all held-out
prompts, one sample each, the evaluate stage's engine and sampling seed), which gives
pass@1 versus RL wall clock for both systems, and samples generated per second.

The comparison is the one a user of this machine sees: ShardRL's RL phase is five
concurrent processes (rollout, score, prepare, learn, evaluate; one torch thread each) on
all cores, its evaluate stage competing with training; TRL is one process using all cores
(`torch.set_num_threads(os.cpu_count())`), and its clock is paused while it is evaluated.
ShardRL's clock starts when its snapshot is published and stops at `DONE.json`; a point of
its curve is the time its policy version was published. TRL runs in a fresh process whose
clock starts at launch (imports, model loading and trainer setup count, as ShardRL's stage
start-up does).

What still differs (TRL 1.16 has no equivalent, or the config has no TRL mapping):
- TRL's `cispo` loss averages over all completion tokens of the batch; ShardRL's demo uses
  prompt-level aggregation (each group's token mean, then the mean over groups).
- TRL keeps groups whose rewards are all equal in its 16-prompt batch (advantage 0, their
  tokens still count in the loss denominator); ShardRL filters them out and fills each step
  with 16 groups that carry signal, so it generates more samples per step.
- TRL trains on-policy (one update per generation batch, ratio 1); ShardRL learns from
  samples up to k=8 versions old with the CISPO ratio capped at `max_ratio`.
- Both normalise advantages by the batch std (TRL adds 1e-4 to it); neither has a KL term.

    .venv/bin/python -m bench.trl_bench --repeats 1
    .venv/bin/python -m bench.trl_bench --snapshot DIR --budget 90 --out trl.json  # TRL only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

Curve = list[tuple[float, float]]
"""(seconds of RL wall clock, held-out pass@1), in time order."""

WORK = Path(__file__).parent / "_work" / "trl"


# -- curve arithmetic (pure) ---------------------------------------------------------------
def time_to_reach(curve: Curve, target: float) -> float | None:
    """Seconds of the first point whose pass@1 is at least `target`; None if none is.

    The curve is sampled at evaluations, so this is the first *measured* time, an upper
    bound on when the rate was first reached (no interpolation between points).
    """
    return next((t for t, p in curve if p >= target - 1e-9), None)


def pass_at(curve: Curve, seconds: float) -> float:
    """pass@1 of the newest point at or before `seconds`: what a user has at that time."""
    before = [p for t, p in curve if t <= seconds]
    if not before:
        raise ValueError(f"the curve has no point at or before {seconds:.1f}s")
    return before[-1]


def compare(shardrl: Curve, trl: Curve) -> dict:
    """The issue's two figures from both curves (each starts at the shared snapshot, t=0).

    `time_ratio`: time ShardRL needed to reach TRL's final pass@1, over TRL's final time
    (target <= 0.5; None when ShardRL never reached it). `pass_gap`: ShardRL's pass@1 at
    TRL's final time minus TRL's final pass@1 (target >= 0). Each side's best pass@1 is
    reported beside them, since neither curve needs to rise monotonically.
    """
    trl_time, trl_pass = trl[-1]
    reach = time_to_reach(shardrl, trl_pass)
    return {"trl_final_pass": trl_pass, "trl_final_seconds": trl_time,
            "trl_best_pass": max(p for _, p in trl),
            "shardrl_best_pass": max(p for _, p in shardrl),
            "shardrl_seconds_to_trl_final": reach,
            "time_ratio": None if reach is None else reach / trl_time,
            "pass_gap": pass_at(shardrl, trl_time) - trl_pass}


# -- ShardRL side --------------------------------------------------------------------------
def run_shardrl(config: str, overrides: list[str], run_id: str) -> dict:
    """Run the pipeline; its curve, RL seconds, sample counts and the snapshot folder."""
    from shardrl.stages.policy import MANIFEST, download_folder
    from shardrl.store import LocalStore, RunKeys

    cmd = [sys.executable, "-m", "shardrl.cli", "run", config, "--store", str(WORK),
           "--run-id", run_id, "--no-progress", "--no-report"]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    store, keys = LocalStore(WORK), RunKeys(run_id)
    run, done = store.get_json(keys.run_json()), store.get_json(keys.done())
    start = run["created"] + run["snapshot_seconds"]
    curve = []
    for key in sorted(k for k in store.list(keys.root + "eval/") if k.endswith(".json")):
        summary = store.get_json(key)
        published = store.get_json(keys.policy_file(summary["version"], MANIFEST))["time"]
        curve.append((max(0.0, published - start), summary["pass_at_1"]))
    accounting = store.get_json(keys.state("runner", "summary.json"))["accounting"]
    snapshot = download_folder(store, keys.policy_prefix(0), WORK / f"{run_id}-snapshot")
    return {"curve": sorted(curve), "seconds": done["time"] - start, "steps": done["steps"],
            "samples": accounting["generated"], "consumed": accounting["consumed"],
            "snapshot": snapshot}


# -- TRL side ------------------------------------------------------------------------------
TRL_SCALE = {"batch": "batch", "prompt": "group", "none": "none"}
"""Our advantage normalisation -> TRL's `scale_rewards`."""


def trl_loss_args(loss) -> dict:
    """GRPOConfig arguments for our policy loss; only CISPO has a TRL counterpart here."""
    if loss.kind != "cispo":
        raise ValueError(f"loss {loss.kind!r} has no TRL mapping here: use algo.loss.kind=cispo")
    # TRL's cispo clamps the ratio at `epsilon_high` itself (an absolute cap, like max_ratio)
    return {"loss_type": "cispo", "epsilon_high": loss.max_ratio}


def verifier_reward(verify: Callable[[str, str], float]) -> Callable[..., list[float]]:
    """A TRL reward function: 1.0 when `verify(completion, answer)` passes, else 0.0."""

    def task_verifier(completions: list[str], answer: list[str], **_) -> list[float]:
        return [1.0 if verify(c, a) >= 1.0 else 0.0
                for c, a in zip(completions, answer, strict=True)]

    return task_verifier


def make_budget_callback(clock_start: float, budget: float, interval: float,
                         evaluate: Callable):
    """A TrainerCallback whose clock runs from `clock_start` (epoch seconds) less the time
    spent evaluating; it evaluates every `interval` seconds of that clock and stops training
    once `budget` seconds are spent."""
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):
        def __init__(self) -> None:
            self.paused, self.next_eval, self.curve = 0.0, interval, []

        def elapsed(self) -> float:
            return time.time() - clock_start - self.paused

        def measure(self, model) -> float:
            """Held-out pass@1 of `model` now, with the clock paused."""
            t0 = time.time()
            value = evaluate(model)
            model.train()
            self.paused += time.time() - t0
            return value

        def on_step_end(self, args, state, control, model=None, **kwargs):
            at = self.elapsed()
            if at >= budget or at >= self.next_eval:
                self.curve.append((at, self.measure(model)))
                while self.next_eval <= at:
                    self.next_eval += interval
            control.should_training_stop = at >= budget
            return control

    return BudgetCallback()


def run_trl(config: str, overrides: list[str], snapshot: Path, budget: float, eval_points: int,
            clock_start: float) -> dict:
    """GRPOTrainer from `snapshot` until `budget` seconds of clock (from `clock_start`,
    evaluations excluded) are spent; its pass@1 curve and sample counts."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from bench.demo_control import heldout_pass
    from shardrl.config import load_config
    from shardrl.models.io import load_causal_lm, load_tokenizer
    from shardrl.tasks.source import make_task

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_config(config, overrides)
    task, lc, ro = make_task(cfg), cfg.learner, cfg.rollout
    # the rollout worker's prompt stream, in order: shard `seq` holds train_items(0, seq, n);
    # 32x the prompts ShardRL's learner takes: TRL, faster per step, also sees fresh prompts
    shards = 32 * lc.total_steps * lc.batch_prompts // ro.prompts_per_shard
    items = [it for s in range(shards) for it in task.train_items(0, s, ro.prompts_per_shard)]
    data = Dataset.from_dict({"prompt": [it.prompt for it in items],
                              "answer": [it.answer for it in items]})
    model, tokenizer = load_causal_lm(snapshot), load_tokenizer(snapshot)
    callback = make_budget_callback(clock_start, budget, budget / eval_points,
                                    lambda m: heldout_pass(m, tokenizer, cfg, task))
    snapshot_pass = callback.measure(model)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=lc.batch_prompts * ro.group_size,
            gradient_accumulation_steps=1, num_generations=ro.group_size, num_iterations=1,
            max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
            top_k=0, learning_rate=lc.lr, lr_scheduler_type="constant_with_warmup",
            warmup_steps=lc.warmup_steps, weight_decay=lc.weight_decay, adam_beta1=lc.beta1,
            adam_beta2=lc.beta2, max_grad_norm=lc.grad_clip or 0.0, beta=0.0,
            scale_rewards=TRL_SCALE[cfg.algo.advantages.norm], max_steps=100 * lc.total_steps,
            shuffle_dataset=False, seed=cfg.seed, report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            **trl_loss_args(cfg.algo.loss))
        trainer = GRPOTrainer(model=model, reward_funcs=verifier_reward(task.verify), args=args,
                              train_dataset=data, processing_class=tokenizer,
                              callbacks=[callback])
        started = callback.elapsed()
        trainer.train()
    steps = trainer.state.global_step
    return {"curve": [(0.0, snapshot_pass), *callback.curve], "seconds": callback.curve[-1][0],
            "steps": steps, "samples": steps * lc.batch_prompts * ro.group_size,
            "startup_seconds": started, "eval_seconds": callback.paused}


def trl_process(config: str, overrides: list[str], snapshot: Path, budget: float,
                eval_points: int) -> dict:
    """`run_trl` in a fresh process (its clock starts at launch: imports count, as they do
    for ShardRL's stage processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        cmd = [sys.executable, "-m", "bench.trl_bench", "--config", config,
               "--snapshot", str(snapshot), "--budget", str(budget),
               "--eval-points", str(eval_points), "--out", str(out),
               "--clock-start", repr(time.time())]
        for o in overrides:
            cmd += ["--set", o]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


# -- driver --------------------------------------------------------------------------------
def one_repeat(config: str, overrides: list[str], tag: str, eval_points: int) -> dict:
    """ShardRL's run, then TRL from its snapshot for as long; both sides and the figures."""
    s = run_shardrl(config, overrides, f"trl-bench-{tag}")
    t = trl_process(config, overrides, s["snapshot"], s["seconds"], eval_points)
    row = {"shardrl": {k: v for k, v in s.items() if k != "snapshot"}, "trl": t}
    for side in (row["shardrl"], row["trl"]):
        side["final_pass"] = side["curve"][-1][1]
        side["samples_per_s"] = side["samples"] / side["seconds"]
    row["samples_per_s_ratio"] = row["shardrl"]["samples_per_s"] / row["trl"]["samples_per_s"]
    return row | compare(s["curve"], t["curve"])


def spread(values: list[float | None]) -> dict:
    """Median, min and max of the defined values (and how many were undefined)."""
    ok = [v for v in values if v is not None]
    if not ok:
        return {"median": None, "min": None, "max": None, "undefined": len(values)}
    return {"median": statistics.median(ok), "min": min(ok), "max": max(ok),
            "undefined": len(values) - len(ok)}


def summarize(rows: list[dict]) -> dict:
    """Medians and ranges over repeats of the figures and of each side's totals."""
    out = {name: spread([row[name] for row in rows])
           for name in ("time_ratio", "pass_gap", "samples_per_s_ratio")}
    for side in ("shardrl", "trl"):
        out[side] = {k: spread([row[side][k] for row in rows])
                     for k in ("final_pass", "samples_per_s", "seconds", "steps")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=10,
                        help="ShardRL evaluates every this many versions; TRL as often in time")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for both systems")
    trl_only = parser.add_argument_group("TRL side only (what the benchmark runs in a process)")
    trl_only.add_argument("--snapshot", type=Path, help="HF folder to start TRL from")
    trl_only.add_argument("--budget", type=float, help="seconds of TRL clock")
    trl_only.add_argument("--eval-points", type=int, default=6)
    trl_only.add_argument("--clock-start", type=float, help="epoch seconds (default: now)")
    trl_only.add_argument("--out", type=Path, help="JSON written here")
    args = parser.parse_args()
    if args.snapshot is not None:
        if args.budget is None or args.out is None:
            parser.error("--snapshot needs --budget and --out")
        result = run_trl(args.config, args.overrides, args.snapshot, args.budget,
                         args.eval_points, args.clock_start or time.time())
        args.out.write_text(json.dumps(result))
        return

    from bench.results import merge_results
    from shardrl.config import load_config

    overrides = ["tracking.enabled=false", f"eval.every={args.eval_every}", *args.overrides]
    steps = load_config(args.config, overrides).learner.total_steps
    eval_points = max(1, steps // args.eval_every)
    rows = []
    for r in range(args.repeats):
        rows.append(one_repeat(args.config, overrides, f"{int(time.time())}-{r}", eval_points))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"config": args.config, "overrides": overrides, "repeats": args.repeats,
               "trl_version": importlib.metadata.version("trl"), "rows": rows} | summarize(rows)
    tr, gap = summary["time_ratio"]["median"], summary["pass_gap"]["median"]
    print(f"ShardRL time to TRL's final pass@1 / TRL's time: "
          f"{'never reached' if tr is None else f'{tr:.2f}'} (target <= 0.5) | "
          f"pass@1 gap at TRL's final time: {gap:+.3f} (target >= 0) | "
          f"samples/s ShardRL / TRL: {summary['samples_per_s_ratio']['median']:.2f}")
    merge_results("trl", summary)


if __name__ == "__main__":
    main()
