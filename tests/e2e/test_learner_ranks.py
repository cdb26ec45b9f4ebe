"""The learn stage on two DeepSpeed ranks under torchrun equals the one-process torch learner.

Both learners start from the same snapshot and the same ready shards (written here, all from
policy version 0 and present from the start: a backlog), so they make the same batches in the
same order: one shard of B groups per step, never the whole backlog at once. The two-rank learner runs ZeRO-3, stops after its first step (`--once`)
and resumes from that checkpoint. The published weights must match the torch learner's, only
rank 0 may have written to the store, and the ledgers must agree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from shardrl.stages.policy import fetch_weights
from shardrl.store import LocalStore, RunKeys
from shardrl.store.schemas import READY
from shardrl.store.shards import write_shard

ROOT = Path(__file__).resolve().parents[2]
RUN = "ranks"
CONFIG = """\
extends: demo
model:
  source: {kind: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
  sft: {enabled: false}
task:
  source: {kind: builtin, heldout_size: 16}
learner: {total_steps: 3, batch_prompts: 2, max_staleness: 2, warmup_steps: 1, ckpt_every: 1,
          poll_interval_s: 0.05, lr: 0.01}
eval: {every: 1}
"""
DEEPSPEED = "learner: {backend: {kind: deepspeed, zero_stage: 3, ranks: 2}}\n"

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the `deepspeed` extra is not installed")


def ready_shard(seq: int, vocab: int, rng: np.random.Generator) -> pa.Table:
    """Two prompt groups of four samples with mixed advantages (all kept), from policy v0."""
    rows: dict[str, list] = {f.name: [] for f in READY}
    for g in range(2):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 6))).tolist()
        for i in range(4):
            response = rng.integers(3, vocab, size=int(rng.integers(2, 6))).tolist()
            logprobs = (-rng.uniform(0.5, 3.0, size=len(response))).tolist()
            reward = float(i % 2)
            rows["prompt_id"].append(f"p{seq}-{g}")
            rows["group_id"].append(f"g{seq}-{g}")
            rows["sample_idx"].append(i)
            rows["policy_version"].append(0)
            rows["worker"].append(0)
            rows["prompt_text"].append("x")
            rows["prompt_token_ids"].append(prompt)
            rows["response_token_ids"].append(response)
            rows["behavior_logprobs"].append(logprobs)
            rows["finish_reason"].append("stop")
            rows["response_text"].append("y")
            rows["answer"].append("y")
            rows["category"].append("c")
            rows["created_at"].append(0.0)
            rows["reward_verifier"].append(reward)
            rows["reward_model"].append(None)
            rows["reward_rm"].append(reward)
            rows["correct"].append(bool(reward))
            rows["reward_error"].append(None)
            rows["ref_logprobs"].append([v - 0.1 for v in logprobs])
            rows["reward_total"].append(reward)
            rows["advantage"].append(reward - 0.5)
            rows["keep"].append(True)
            rows["filter_reason"].append(None)
    return pa.table(rows, schema=READY)


def learn_command(store: Path, config: Path, ranks: int, *extra: str) -> tuple[list[str], dict]:
    argv = ["stage", "learn", "--config", str(config), "--run-id", RUN, "--store", str(store),
            *extra]
    launcher = [sys.executable, "-m", "shardrl.cli"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={ranks}", "-m", "shardrl.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".shardrl" / "torch_extensions"),
               SHARDRL_CACHE=str(store.parent / "cache"))
    return [*launcher, *argv], env


def learn(store: Path, config: Path, ranks: int, *extra: str) -> None:
    command, env = learn_command(store, config, ranks, *extra)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def snapshot(store: Path, config: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "shardrl.cli", "stage", "snapshot", "--config",
                           str(config), "--run-id", RUN, "--store", str(store)],
                          env=dict(os.environ, SHARDRL_CACHE=str(store.parent / "cache")),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def op_loaded(pid: int) -> bool:
    """Whether process `pid` has DeepSpeed's shared-memory communication op mapped."""
    try:
        return "deepspeed_shm_comm" in (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@needs_deepspeed
def test_two_zero3_ranks_match_the_torch_learner_and_resume(tmp_path: Path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    ds_config = tmp_path / "ds.yaml"
    ds_config.write_text(f"extends: {config}\n{DEEPSPEED}")
    base = tmp_path / "base"
    snapshot(base, config)
    keys = RunKeys(RUN)
    store = LocalStore(str(base))
    vocab = json.loads(store.get_bytes(keys.policy_file(0, "config.json")))["vocab_size"]
    rng = np.random.default_rng(0)
    for seq in range(3):  # B=2 groups per step: one shard per step, the last at lag k=2
        write_shard(store, keys.shard("ready", 0, 0, seq), ready_shard(seq, vocab, rng), READY)

    single, multi = tmp_path / "single", tmp_path / "multi"
    shutil.copytree(base, single)
    shutil.copytree(base, multi)
    learn(single, config, 1)
    learn(multi, ds_config, 2, "--once")
    progress = json.loads((multi / keys.state("learn", "progress.json")).read_text())
    assert progress["version"] == 1  # stopped after one step, as asked
    learn(multi, ds_config, 2)  # resumes from the step-1 checkpoint on both ranks

    for version in (1, 2, 3):  # deltas on v0, rebuilt by a reader
        a = fetch_weights(LocalStore(str(single)), keys, version)
        b = fetch_weights(LocalStore(str(multi)), keys, version)
        assert a.keys() == b.keys()
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert worst < 1e-5, (version, worst)
    # the weights did move: this is not two copies of the snapshot
    v0 = load_file(single / keys.policy_file(0, "model.safetensors"))
    v3 = fetch_weights(LocalStore(str(single)), keys, 3)
    assert max(float((v0[k] - v3[k]).abs().max()) for k in v0) > 1e-3

    def ledger(root: Path) -> list[list[str]]:
        files = sorted((root / keys.root / "state" / "learn").glob("ledger-*.json"))
        return [sorted(s["key"] for s in json.loads(f.read_text())["shards"]) for f in files]

    assert ledger(single) == ledger(multi) == [[keys.shard("ready", 0, 0, seq)] for seq in range(3)]
    counts = [json.loads((r / keys.done()).read_text())["counts"] for r in (single, multi)]
    assert counts[0] == counts[1] == {"consumed": 24, "filtered": 0}
    # one writer: every metrics chunk is rank 0's, one set of points per step
    steps = []
    for chunk in (multi / keys.root / "metrics" / "learn").rglob("*.parquet"):
        t = pq.read_table(chunk)
        steps += [s for n, s in zip(t.column("name").to_pylist(), t.column("step").to_pylist(),
                                    strict=True) if n == "learn/grad_norm"]
    assert sorted(steps) == [1, 2, 3]


@needs_deepspeed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal")
def test_ranks_die_with_their_killed_launcher(tmp_path: Path):
    """torchrun starts each rank in a session of its own, so nothing that stops torchrun
    reaches them: SIGKILLed (as the local runner's own death takes it down), it used to leave
    both ranks running, rank 0 waiting for shards beside whatever learner came next."""
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    ds_config = tmp_path / "ds.yaml"
    ds_config.write_text(f"extends: {config}\n{DEEPSPEED}")
    store = tmp_path / "store"
    snapshot(store, config)
    command, env = learn_command(store, ds_config, 2)  # no shards: the learner waits for them
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        # each rank makes its cache folder, named with its pid, once it runs the stage, and
        # has DeepSpeed's communication op mapped once it loaded it: killed before, a rank
        # could leave the op's build lock behind for the tests after this one
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ranks = children(launcher.pid)
            cached = {p.name.rpartition("-")[2] for p in (tmp_path / "cache").glob(f"{RUN}/*")}
            if (len(ranks) == 2 and {str(p) for p in ranks} <= cached
                    and all(op_loaded(p) for p in ranks)):
                break
            assert launcher.poll() is None, "the learner ended before its ranks started"
            time.sleep(0.2)
        else:
            pytest.fail(f"the ranks did not start: {ranks}")
        time.sleep(1.0)  # both ranks now wait: rank 0 for shards, rank 1 for rank 0's plan
        assert all(alive(p) for p in ranks)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if alive(p)], "ranks outlived their launcher"
    finally:
        launcher.kill()
        for p in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
