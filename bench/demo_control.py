"""The demo's claim, measured: RL after an SFT plateau versus SFT continued for as long.

For each seed: run the `demo` pipeline; read held-out pass@1 of the SFT snapshot (v0) and of
the final policy; then, as a control, continue SFT from the same snapshot on the same
demonstrations for as long (wall clock) as the RL phase lasted, and evaluate it the same way
(same held-out prompts, temperature and sampling seed).

    .venv/bin/python -m bench.demo_control --seeds 0 1 2
    .venv/bin/python -m bench.demo_control --seeds 0 1 2 --total-steps 40  # shorter RL phases

A seed costs about the snapshot, its RL phase twice (RL, then the control for as long) and
a few evaluations (about 45 s with the demo on 2 cores); `--total-steps` shortens the RL
phase, and with it the control. The control trains with every core, as the RL phase's
stages share them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.results import merge_results
from shardrl.config import load_config
from shardrl.engines.hf import HFEngine
from shardrl.stages.evaluate import EVAL_SEED
from shardrl.stages.policy import load_policy
from shardrl.stages.sft import answer_loss, encode_pairs
from shardrl.store import LocalStore, RunKeys
from shardrl.tasks.prompts import PromptFormat
from shardrl.tasks.source import make_task

WORK = Path(__file__).parent / "_work"


def heldout_pass(model, tokenizer, cfg, task) -> float:
    engine = HFEngine(model.eval(), eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, fp32_lm_head=cfg.model.fp32_lm_head)
    items = task.heldout
    prompts = PromptFormat.from_config(cfg).encode(tokenizer, [it.prompt for it in items])
    out = engine.generate(prompts, cfg.eval.samples_per_prompt, temperature=cfg.eval.temperature,
                          top_p=1.0, max_new_tokens=cfg.eval_max_new_tokens, seed=EVAL_SEED)
    ok = [task.verify(tokenizer.decode(s.token_ids, skip_special_tokens=True), it.answer)
          for it, samples in zip(items, out, strict=True) for s in samples]
    return sum(ok) / len(ok)


def continue_sft(model, tokenizer, cfg, task, seconds: float) -> int:
    sft = cfg.model.sft
    rows = encode_pairs(tokenizer, task.demonstrations(sft.demonstrations),
                        PromptFormat.from_config(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr)
    rng, steps, start = random.Random(cfg.seed), 0, time.monotonic()
    model.train()
    while time.monotonic() - start < seconds:
        rng.shuffle(rows)
        for i in range(0, len(rows), sft.batch_size):
            loss = answer_loss(model, rows[i: i + sft.batch_size], tokenizer.pad_token_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            steps += 1
            if time.monotonic() - start >= seconds:
                break
    return steps


def step_overrides(config: str, total_steps: int | None) -> list[str]:
    """Overrides that end the RL phase at `total_steps` (None: the config's), evaluating at
    least once between the snapshot and the end."""
    if total_steps is None:
        return []
    every = load_config(config, []).eval.every
    return [f"learner.total_steps={total_steps}",
            f"eval.every={every if every < total_steps else max(1, total_steps // 2)}"]


def one_seed(seed: int, config: str, total_steps: int | None = None) -> dict:
    store_dir = WORK / "demo-control"
    run_id = f"demo-seed{seed}-{int(time.time())}"
    sets = [f"seed={seed}", *step_overrides(config, total_steps)]
    cmd = [sys.executable, "-m", "shardrl.cli", "run", config, "--store", str(store_dir),
           "--run-id", run_id, "--no-progress", "--set", "tracking.enabled=false"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    store, keys = LocalStore(store_dir), RunKeys(run_id)
    run = store.get_json(keys.run_json())
    done = store.get_json(keys.done())
    rl_seconds = done["time"] - (run["created"] + run["snapshot_seconds"])
    evals = {int(k.rsplit("/v", 1)[1][:6]): store.get_json(k)
             for k in store.list(keys.root + "eval/") if k.endswith(".json")}
    cfg = load_config(config, sets)
    task = make_task(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load_policy(store, keys, 0, Path(tmp))
    torch.set_num_threads(os.cpu_count() or 1)
    steps = continue_sft(model, tokenizer, cfg, task, rl_seconds)
    control = heldout_pass(model, tokenizer, cfg, task)
    return {"seed": seed, "sft_plateau": evals[0]["pass_at_1"],
            "rl_final": evals[max(evals)]["pass_at_1"], "rl_version": max(evals),
            "sft_continued": control,
            "rl_seconds": round(rl_seconds, 1), "control_sft_steps": steps,
            "sft_epochs": run["sft"]["epochs"], "heldout_prompts": evals[0]["prompts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--total-steps", type=int,
                        help="end each RL phase at this many learner steps (default: config's)")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(seed, args.config, args.total_steps))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| seed | SFT plateau | RL final | RL gain | SFT continued | control gain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft_plateau']:.3f} | {r['rl_final']:.3f} | "
              f"{100 * (r['rl_final'] - r['sft_plateau']):+.1f} pts | {r['sft_continued']:.3f} | "
              f"{100 * (r['sft_continued'] - r['sft_plateau']):+.1f} pts |")
    cfg = load_config(args.config, step_overrides(args.config, args.total_steps))
    merge_results("demo_control", {"rows": rows, "config": args.config,
                                   "total_steps": cfg.learner.total_steps})


if __name__ == "__main__":
    main()
