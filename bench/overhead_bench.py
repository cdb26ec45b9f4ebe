"""Stage overhead: the learn and rollout stages against bare in-process loops doing the same work.

Learner: a store holds a snapshot and `steps` steps' worth of ready shards from the start (the
demo's shapes: 8 prompt groups of 8 samples per shard, two shards per step of B=16 groups;
prompts of 5-8 tokens and responses of 8, a quarter of them ending early, as the demo's
policy v0 writes them). `shardrl stage learn` runs them as its own process. Its `ratio` takes
its wall clock from the start of its first step to DONE.json (`startup_s` before that:
imports, model load, reading the whole backlog; `exit_s` after); `ratio_steady` starts at the
end of the first step on both sides, leaving one-time costs out. The bare loop loads the
same v0 weights and makes the same batches in the same order (from the stage's ledger) with
`compute_loss`, backward, gradient clipping and AdamW, and no store; its final weights must
equal the stage's last published version (`max_weight_diff`). Like the stage, it runs in a
fresh process each repeat (`--bare-learn`), so both sides start cold: torch's lazy set-up
and the allocator's heap are not left warm by an earlier repeat on one side only.

Rollout: `shardrl stage rollout` generates `shards` shards from policy v0 (nothing consumes
them: the backlog bound is `shards`, then the bench writes DONE.json), BATCH shards per
generation call (`rollout.max_batch_shards`): a shard's `created_at` is stamped after its
call, and the window opens at the end of a call, so it counts only the tokens of calls made
inside it (with up to 8 shards per call and the window opening inside the first, it once
counted shards generated before it: up to twice the stage's real rate on the large model).
Its steady state runs from shard WARMUP-1's creation to the last one's. The stage's own
overhead is read against its engine alone (`HFEngine.generate`, its sampling loop and
shared-prompt forward) on the same prompts in the same calls of BATCH shards, timed from
shard WARMUP on; and, for reference, against `model.generate` (another sampling loop) on
each shard's prompts (left-padded), the same group size, temperature, max_new_tokens and
threads.

Both at the demo's model size and a larger one (hidden 256, 4 layers), where a step is
heavier and the stages' fixed per-step costs weigh less. Each repeat runs stage then bare,
all repeats of one scale before the next scale; medians with min and max over repeats.
Tokens are response tokens.

    .venv/bin/python -m bench.overhead_bench --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.results import merge_results
from shardrl.config import load_config
from shardrl.stages.staleness import shards_per_step
from shardrl.store import LocalStore, RunKeys
from shardrl.store.schemas import READY, ROLLOUT
from shardrl.store.shards import read_shard, write_shard

WORK = Path(__file__).parent / "_work" / "overhead"
RUN = "overhead"
KEYS = RunKeys(RUN)
SCALES = {
    "demo": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256},
    "large": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024},
}
GROUPS, GROUP_SIZE, RESPONSE = 16, 8, 8
"""Prompt groups per shard, samples per group, max_new_tokens (the demo's)."""
TARGET = 0.90
WARMUP = 2
"""Rollout shards left out of the steady-state window (both sides)."""
BATCH = 2
"""Shards per generation call of the rollout stage (`rollout.max_batch_shards`; about what a
demo worker generates at once, its backlog allowing); WARMUP and PAIRED_SHARDS are multiples
of it, so the window opens and each paired run ends at a call's end."""
PAIRED_SHARDS = 8
"""Consecutive rollout shards per pair of the paired figure. The stage generates several
shards in one call and writes them within milliseconds of each other, so a shard alone has
no duration of its own; eight span a few calls on both sides."""
PAIRED_UNIT = {"learn": "step", "rollout": f"{PAIRED_SHARDS} shards"}
"""What the paired figure of each part pairs."""


def config_text(scale: str, steps: int, shards: int) -> str:
    """The demo preset at `scale`, without SFT, every ready shard admissible."""
    source = {"kind": "tiny", **SCALES[scale], "max_position_embeddings": 32}
    return (f"extends: demo\nname: overhead-{scale}\n"
            f"model: {{source: {source}, sft: {{enabled: false}}}}\n"
            f"rollout: {{prompts_per_shard: {GROUPS}, max_backlog_steps: {shards}, "
            f"max_batch_shards: {BATCH}, postprocess: stages, "
            f"poll_interval_s: 0.05}}\n"
            f"learner: {{total_steps: {steps}, max_staleness: 100000}}\n"
            f"eval: {{every: {steps}}}\ntracking: {{enabled: false}}\n").replace("'", "")


def ready_shard(seq: int, vocab: int, rng: np.random.Generator) -> pa.Table:
    """GROUPS groups of GROUP_SIZE samples from policy v0, half rewarded, all kept."""
    rows: dict[str, list] = {f.name: [] for f in READY}
    for g in range(GROUPS):
        prompt = rng.integers(3, vocab, size=int(rng.integers(5, 9))).tolist()
        for i in range(GROUP_SIZE):
            length = RESPONSE if rng.random() < 0.75 else int(rng.integers(1, RESPONSE))
            response = rng.integers(3, vocab, size=length).tolist()
            logprobs = (-rng.uniform(0.5, 3.0, size=length)).tolist()
            reward = float(i % 2)
            values = {
                "prompt_id": f"p{seq}-{g}", "group_id": f"g{seq}-{g}", "sample_idx": i,
                "policy_version": 0, "worker": 0, "prompt_text": "x",
                "prompt_token_ids": prompt, "response_token_ids": response,
                "behavior_logprobs": logprobs, "finish_reason": "length",
                "response_text": "y", "answer": "y", "category": "c", "created_at": 0.0,
                "reward_verifier": reward, "reward_model": None, "reward_rm": reward,
                "correct": bool(reward), "reward_error": None,
                "ref_logprobs": [v - 0.1 for v in logprobs], "reward_total": reward,
                "advantage": reward - 0.5, "keep": True, "filter_reason": None,
            }
            for name, value in values.items():
                rows[name].append(value)
    return pa.table(rows, schema=READY)


def stage_cmd(name: str, config: Path, store: Path) -> list[str]:
    return [sys.executable, "-m", "shardrl.cli", "stage", name, "--config", str(config),
            "--run-id", RUN, "--store", str(store)]


def stage_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", SHARDRL_CACHE=str(WORK / "cache"))


def setup(scale: str, steps: int, shards: int) -> tuple[Path, Path, Path]:
    """(config, snapshot-only store, store with the ready backlog) for one scale."""
    root = WORK / scale
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = root / "config.yaml"
    config.write_text(config_text(scale, steps, shards))
    base = root / "base"
    with open(root / "snapshot.log", "w") as log:
        subprocess.run(stage_cmd("snapshot", config, base), env=stage_env(), check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    backlog = root / "backlog"
    shutil.copytree(base, backlog)
    store = LocalStore(str(backlog))
    vocab = int(store.get_json(KEYS.policy_file(0, "config.json"))["vocab_size"])
    rng = np.random.default_rng(0)
    cfg = load_config(str(config))
    per_step = shards_per_step(cfg.learner.batch_prompts, cfg.rollout.prompts_per_shard, 1)
    for seq in range(steps * per_step):
        write_shard(store, KEYS.shard("ready", 0, 0, seq), ready_shard(seq, vocab, rng), READY)
    return config, base, backlog


def learn_window(points: list[tuple[str, int, float, float]], done_time: float) -> dict:
    """The learn stage's windows from its metric points (name, step, value, time).

    Each step logs its points once it is committed, and `samples / samples_per_s` is its
    duration, so the first step started that long before its points. Returns
    {first_step_start, wall_s, tokens}: from the first step's start to DONE.json, all steps'
    response tokens; {steady_wall_s, steady_tokens}: from the first step's end, the later
    steps only (one-time costs of the first step left out); and per step (from the previous
    step's end to its own), {step_s, step_tokens}.
    """
    by_step: dict[int, dict[str, float]] = {}
    logged: dict[int, float] = {}
    for name, step, value, t in points:
        by_step.setdefault(step, {})[name] = value
        logged[step] = t
    first = min(by_step)
    m = by_step[first]
    start = logged[first] - m["learn/samples"] / m["learn/samples_per_s"]
    steps = sorted(by_step)
    tokens = [int(by_step[s]["learn/tokens"]) for s in steps]
    durations = [logged[first] - start] + [logged[b] - logged[a] for a, b in pairwise(steps)]
    return {"first_step_start": start, "wall_s": done_time - start, "tokens": sum(tokens),
            "steady_wall_s": done_time - logged[first], "steady_tokens": sum(tokens[1:]),
            "step_s": durations, "step_tokens": tokens}


def learn_stage(config: Path, backlog: Path, work: Path) -> dict:
    store_dir = work / "learn"
    shutil.rmtree(store_dir, ignore_errors=True)
    shutil.copytree(backlog, store_dir)
    started = time.time()
    with open(work / "learn.log", "w") as log:
        subprocess.run(stage_cmd("learn", config, store_dir), env=stage_env(), check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    ended = time.time()
    store = LocalStore(str(store_dir))
    points = []
    for key in store.list(KEYS.root + "metrics/learn/"):
        t = pq.read_table(io.BytesIO(store.get_bytes(key)))
        points += zip(t.column("name").to_pylist(), t.column("step").to_pylist(),
                      t.column("value").to_pylist(), t.column("time").to_pylist(), strict=True)
    done = store.get_json(KEYS.done())
    window = learn_window(points, done["time"])
    batches = [[entry["key"] for entry in store.get_json(k)["shards"]]
               for k in store.list(KEYS.state("learn", "ledger-"))]
    return {"wall_s": window["wall_s"], "tokens": window["tokens"],
            "tokens_per_s": window["tokens"] / window["wall_s"],
            "steady_tokens_per_s": window["steady_tokens"] / window["steady_wall_s"],
            "step_tokens_per_s": [n / t for n, t in zip(window["step_tokens"], window["step_s"],
                                                        strict=True)],
            "startup_s": window["first_step_start"] - started, "exit_s": ended - done["time"],
            "batches": batches, "store": store_dir}


def learn_bare(cfg, folder: Path, tables: list[pa.Table]) -> dict:
    """The same updates as the learn stage, in this process: no store, no publishing.

    tables: one per step, the step's shards concatenated in the stage's order.
    """
    import torch

    from shardrl.algo import lr_schedule
    from shardrl.learner_backends.base import PolicyModule
    from shardrl.models.io import load_causal_lm, load_tokenizer
    from shardrl.stages.update import compute_loss

    lc = cfg.learner
    model = load_causal_lm(folder)
    model.train()
    pad_id = load_tokenizer(folder).pad_token_id
    policy = PolicyModule(model, share_prompts=lc.share_prompts)  # as the stage computes
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lc.lr, betas=(lc.beta1, lc.beta2),
                            weight_decay=lc.weight_decay)
    tokens, ends = [], []
    started = time.perf_counter()
    for step, table in enumerate(tables):
        kept = table.filter(table.column("keep"))
        for group in opt.param_groups:
            group["lr"] = lc.lr * lr_schedule(step, warmup_steps=lc.warmup_steps,
                                              total_steps=lc.total_steps, kind=lc.schedule,
                                              min_ratio=lc.min_lr_ratio)
        loss, _, _ = compute_loss(cfg, policy, kept, pad_id, 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
        opt.step()
        tokens.append(sum(len(r) for r in kept.column("response_token_ids").to_pylist()))
        ends.append(time.perf_counter())
    wall = ends[-1] - started
    return {"wall_s": wall, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall,
            "steady_tokens_per_s": sum(tokens[1:]) / (ends[-1] - ends[0]),
            "step_tokens_per_s": [n / (b - a) for n, a, b in
                                  zip(tokens, [started, *ends[:-1]], ends, strict=True)],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def learn_bare_process(config: Path, folder: Path, tables: list[pa.Table], work: Path) -> dict:
    """`learn_bare` in a fresh process with the stage's environment (one thread), started
    cold as the stage is: its tables go through Parquet files, its final weights come back
    as safetensors."""
    from safetensors.torch import load_file

    inputs = work / "bare-learn"
    shutil.rmtree(inputs, ignore_errors=True)
    inputs.mkdir(parents=True)
    for i, table in enumerate(tables):
        pq.write_table(table, inputs / f"step-{i:04d}.parquet")
    cmd = [sys.executable, "-m", "bench.overhead_bench", "--bare-learn", str(config),
           str(folder), str(inputs)]
    with open(work / "bare-learn.log", "w") as log:
        subprocess.run(cmd, env=stage_env(), check=True, stdout=log, stderr=subprocess.STDOUT,
                       cwd=Path(__file__).resolve().parent.parent)
    out = json.loads((inputs / "result.json").read_text())
    out["weights"] = load_file(inputs / "weights.safetensors")
    shutil.rmtree(inputs)
    return out


def bare_learn_main(config: Path, folder: Path, inputs: Path) -> None:
    """The child side of `learn_bare_process`."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    tables = [pq.read_table(p) for p in sorted(inputs.glob("step-*.parquet"))]
    out = learn_bare(load_config(str(config)), folder, tables)
    save_file({k: v.contiguous() for k, v in out.pop("weights").items()},
              inputs / "weights.safetensors")
    (inputs / "result.json").write_text(json.dumps(out))


def max_weight_diff(bare: dict, store_dir: Path, version: int) -> float:
    """Largest |bare - stage| over the weights of the stage's published `version`."""
    from shardrl.stages.policy import fetch_weights
    from shardrl.store import LocalStore

    published = fetch_weights(LocalStore(str(store_dir)), KEYS, version)
    return max(float((bare[k] - v).abs().max()) for k, v in published.items())


def rollout_window(shards: list[pa.Table]) -> dict:
    """Steady state of the rollout stage: from shard WARMUP-1's creation to the last one's.

    shards: in write order. A shard's `created_at` is taken after its generation, so the
    window holds whole cycles (table and write of one shard, backlog and reload checks,
    generation of the next) of shards WARMUP..; their response tokens are counted, also per
    `PAIRED_SHARDS` consecutive shards (`shard_tokens_per_s`, a partial last run left out).
    The first shards carry one-time costs (first forward, lazy imports on the first table).
    """
    created = [float(t.column("created_at")[0].as_py()) for t in shards]
    tokens = [sum(len(r) for r in t.column("response_token_ids").to_pylist()) for t in shards]
    wall = created[-1] - created[WARMUP - 1]
    return {"wall_s": wall, "tokens": sum(tokens[WARMUP:]),
            "tokens_per_s": sum(tokens[WARMUP:]) / wall, "first_shard_time": created[0],
            "shard_tokens_per_s": [sum(tokens[i:i + PAIRED_SHARDS])
                                   / (created[i + PAIRED_SHARDS - 1] - created[i - 1])
                                   for i in range(WARMUP, len(shards) - PAIRED_SHARDS + 1,
                                                  PAIRED_SHARDS)]}


def rollout_stage(config: Path, base: Path, work: Path, shards: int) -> dict:
    store_dir = work / "rollout"
    shutil.rmtree(store_dir, ignore_errors=True)
    shutil.copytree(base, store_dir)
    store = LocalStore(str(store_dir))
    prefix = KEYS.version_prefix("rollouts", 0)
    started = time.time()
    with open(work / "rollout.log", "w") as log:
        proc = subprocess.Popen(stage_cmd("rollout", config, store_dir), env=stage_env(),
                                stdout=log, stderr=subprocess.STDOUT)
        while len(store.list(prefix)) < shards and proc.poll() is None:
            time.sleep(0.05)
        store.put_json(KEYS.done(), {"time": time.time()})  # the stage stops at DONE.json
        if proc.wait() != 0:
            raise RuntimeError(f"rollout stage failed: see {work / 'rollout.log'}")
    tables = [read_shard(store, key, ROLLOUT) for key in store.list(prefix)][:shards]
    shutil.rmtree(store_dir)
    window = rollout_window(tables)
    return {"wall_s": window["wall_s"], "tokens": window["tokens"],
            "tokens_per_s": window["tokens"] / window["wall_s"],
            "shard_tokens_per_s": window["shard_tokens_per_s"],
            "to_first_shard_s": window["first_shard_time"] - started, "tables": tables}


def timed(per_call: list[tuple[int, float]], wall: float, paired: int) -> dict:
    """A bare generation loop's figures from its timed calls (tokens, seconds) and its wall
    clock: tokens/s over the wall, and per `paired` calls (PAIRED_SHARDS shards; a partial
    last run left out) for the paired figure."""
    tokens = sum(n for n, _ in per_call)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "shard_tokens_per_s": [sum(n for n, _ in per_call[i:i + paired])
                                   / sum(t for _, t in per_call[i:i + paired])
                                   for i in range(0, len(per_call) - paired + 1, paired)]}


def rollout_engine(cfg, folder: Path, shards: list[list[list[int]]]) -> dict:
    """The stage's own engine (`HFEngine.generate`, as a rollout worker calls it: its sampling
    loop and shared-prompt forward) on the shards' prompts in calls of BATCH shards, as the
    stage makes them, timed from shard WARMUP on: what the stage does minus the stage, so
    stage / this is the stage's own overhead."""
    from shardrl.engines.hf import HFEngine
    from shardrl.models.io import load_causal_lm, load_tokenizer

    rc = cfg.rollout
    tok = load_tokenizer(folder)
    engine = HFEngine(load_causal_lm(folder), eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, fp32_lm_head=cfg.model.fp32_lm_head)
    per_call = []
    for i in range(0, len(shards) - BATCH + 1, BATCH):
        if i == WARMUP:
            started = time.perf_counter()
        begun = time.perf_counter()
        prompts = [p for shard in shards[i:i + BATCH] for p in shard]
        groups = engine.generate(prompts, rc.group_size, temperature=rc.temperature,
                                 top_p=rc.top_p, max_new_tokens=rc.max_new_tokens, seed=i)
        if i >= WARMUP:
            tokens = sum(len(s.token_ids) for g in groups for s in g)
            per_call.append((tokens, time.perf_counter() - begun))
    return timed(per_call, time.perf_counter() - started, PAIRED_SHARDS // BATCH)


def shard_prompts(table: pa.Table) -> list[list[int]]:
    """The prompt of each group of a rollout shard, in group order."""
    seen: dict[str, list[int]] = {}
    for gid, prompt in zip(table.column("group_id").to_pylist(),
                           table.column("prompt_token_ids").to_pylist(), strict=True):
        seen.setdefault(gid, prompt)
    return list(seen.values())


def rollout_bare(cfg, folder: Path, shards: list[list[list[int]]]) -> dict:
    """`model.generate` on each shard's prompts (left-padded, G samples each), timed from
    shard WARMUP on.

    Generated tokens of a row: up to and including its first eos, else max_new_tokens.
    """
    import torch

    from shardrl.models.io import load_causal_lm, load_tokenizer

    rc = cfg.rollout
    model = load_causal_lm(folder).eval()
    tok = load_tokenizer(folder)
    per_shard = []
    for i, prompts in enumerate(shards):
        if i == WARMUP:
            started = time.perf_counter()
        begun = time.perf_counter()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True,
                             temperature=rc.temperature, top_p=rc.top_p, top_k=0,
                             max_new_tokens=rc.max_new_tokens, num_return_sequences=rc.group_size,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[:, width:]  # (B*G, N)
        is_eos = new == tok.eos_token_id
        lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new.shape[1])
        if i >= WARMUP:
            per_shard.append((int(lengths.sum()), time.perf_counter() - begun))
    return timed(per_shard, time.perf_counter() - started, PAIRED_SHARDS)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_median(stage: list[float], bare: list[float]) -> float:
    """Median over steps (or runs of shards) of stage / bare tokens/s, the same work paired by
    index: a load burst on the machine spoils a few pairs rather than a whole window."""
    return statistics.median(s / b for s, b in zip(stage, bare, strict=True))


def summarize(runs: list[dict], stage_fields: tuple[str, ...]) -> dict:
    """Median, min and max over repeats of the ratios, both sides' tokens/s and `stage_fields`."""
    out = {name: spread([r[name] for r in runs]) for name in runs[0] if name.startswith("ratio")}
    for side in ("stage", "bare", "engine"):
        if side in runs[0]:
            out[f"{side}_tokens_per_s"] = spread([r[side]["tokens_per_s"] for r in runs])
    out |= {name: spread([r["stage"][name] for r in runs]) for name in stage_fields}
    # the stage's own overhead: against the same engine alone where there is one (rollout)
    out["meets_target"] = out.get("ratio_engine", out["ratio"])["median"] >= TARGET
    return out | {"runs": runs}


def measure(scale: str, prepared: tuple[Path, Path, Path], shards: int, work: Path,
            ) -> tuple[dict, dict]:
    """One repeat at one scale: learn stage, bare learner, rollout stage, bare generate."""
    config, base, backlog = prepared
    cfg = load_config(str(config))
    folder = base / KEYS.policy_prefix(0)
    stage = learn_stage(config, backlog, work)
    store = LocalStore(str(backlog))
    tables = [pa.concat_tables([read_shard(store, k, READY) for k in keys])
              for keys in stage.pop("batches")]
    bare = learn_bare_process(config, folder, tables, work)
    store_dir = stage.pop("store")
    diff = max_weight_diff(bare.pop("weights"), store_dir, len(tables))
    shutil.rmtree(store_dir)
    learn = {"stage": stage, "bare": bare, "max_weight_diff": diff,
             "ratio": stage["tokens_per_s"] / bare["tokens_per_s"],
             "ratio_steady": stage["steady_tokens_per_s"] / bare["steady_tokens_per_s"],
             "ratio_step_median": paired_median(stage.pop("step_tokens_per_s"),
                                                bare.pop("step_tokens_per_s"))}
    gen = rollout_stage(config, base, work, shards)
    prompts = [shard_prompts(t) for t in gen.pop("tables")]
    gen_bare = rollout_bare(cfg, folder, prompts)
    gen_engine = rollout_engine(cfg, folder, prompts)
    per_shard = gen.pop("shard_tokens_per_s")
    rollout = {"stage": gen, "bare": gen_bare, "engine": gen_engine,
               "ratio": gen["tokens_per_s"] / gen_bare["tokens_per_s"],
               "ratio_engine": gen["tokens_per_s"] / gen_engine["tokens_per_s"],
               "ratio_step_median": paired_median(per_shard, gen_bare.pop("shard_tokens_per_s")),
               "ratio_engine_step_median": paired_median(
                   per_shard, gen_engine.pop("shard_tokens_per_s"))}
    for part, r in (("learn", learn), ("rollout", rollout)):
        print(f"{scale} {part}: stage {r['stage']['tokens_per_s']:.0f} tok/s, bare "
              f"{r['bare']['tokens_per_s']:.0f} tok/s, ratio {r['ratio']:.3f} (paired per "
              f"{PAIRED_UNIT[part]} {r['ratio_step_median']:.3f})", flush=True)
    print(f"{scale} rollout: engine alone {gen_engine['tokens_per_s']:.0f} tok/s, stage / "
          f"engine {rollout['ratio_engine']:.3f}", flush=True)
    return learn, rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs=2, default=(30, 10), metavar=("DEMO", "LARGE"),
                        help="learner steps at the demo scale and the large one")
    parser.add_argument("--shards", type=int, nargs=2, default=(40, 12), metavar=("DEMO", "LARGE"),
                        help="rollout shards at the demo scale and the large one")
    parser.add_argument("--scales", nargs="+", default=list(SCALES), choices=list(SCALES))
    parser.add_argument("--bare-learn", nargs=3, type=Path, metavar=("CONFIG", "FOLDER", "INPUTS"),
                        help=argparse.SUPPRESS)  # the fresh process of `learn_bare_process`
    args = parser.parse_args()
    if args.bare_learn:
        bare_learn_main(*args.bare_learn)
        return
    import torch

    torch.set_num_threads(1)  # the stages' threads (learner.threads, rollout.threads)
    steps = dict(zip(SCALES, args.steps, strict=True))
    shards = dict(zip(SCALES, args.shards, strict=True))
    started = time.monotonic()
    prepared = {s: setup(s, steps[s], shards[s]) for s in args.scales}
    runs: dict[str, dict[str, list[dict]]] = {s: {"learn": [], "rollout": []} for s in args.scales}
    # one scale after the other: the bare generate loop runs in this process, and a bare loop
    # at the demo's size ran about 9% faster after one at the large size (its allocator's heap
    # grown by the larger activations: fewer page faults per step), which no stage process is
    for scale in args.scales:
        for r in range(args.repeats):  # stage and bare alternate: drifting load hits both alike
            learn, rollout = measure(scale, prepared[scale], shards[scale], WORK / scale / f"r{r}")
            runs[scale]["learn"].append(learn)
            runs[scale]["rollout"].append(rollout)
    summary: dict = {"target": TARGET, "repeats": args.repeats, "threads": 1}
    for scale in args.scales:
        learn = summarize(runs[scale]["learn"], ("startup_s", "exit_s"))
        learn["max_weight_diff"] = max(x["max_weight_diff"] for x in runs[scale]["learn"])
        summary[scale] = {
            "model": SCALES[scale],
            "learn": {"steps": steps[scale]} | learn,
            "rollout": {"shards": shards[scale], "steady_from_shard": WARMUP}
            | summarize(runs[scale]["rollout"], ("to_first_shard_s",)),
        }
        for part in ("learn", "rollout"):
            ratios = summary[scale][part]
            print(f"{scale} {part}: stage/bare tokens/s median {ratios['ratio']['median']:.3f}"
                  f" (paired per {PAIRED_UNIT[part]} "
                  f"{ratios['ratio_step_median']['median']:.3f})")
    summary["bench_seconds"] = time.monotonic() - started
    shutil.rmtree(WORK / "cache", ignore_errors=True)  # each stage process cached its model
    merge_results("overhead", summary)


if __name__ == "__main__":
    main()
