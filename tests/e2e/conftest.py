"""Helpers for end-to-end runs of the local runner on tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = """\
extends: demo
name: tiny
model:
  source: {kind: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
  sft: {demonstrations: 64, max_epochs: 2, patience: 1, batch_size: 32}
task:
  source: {kind: builtin, heldout_size: 16}
rollout: {prompts_per_shard: 2, group_size: 4, max_new_tokens: 5, poll_interval_s: 0.05}
learner: {total_steps: 6, batch_prompts: 2, max_staleness: 2, warmup_steps: 1, ckpt_every: 1,
          poll_interval_s: 0.05, publish: {full_every: 4}}
eval: {every: 3}
# an untrained model rarely has a group with mixed rewards: keep every group so steps happen
algo: {filters: {zero_variance: false}}
promote: {model_name: tiny-e2e}
"""


def run_cli(args: list[str], cwd: Path, timeout: int = 600, **popen) -> subprocess.CompletedProcess:
    if args[:1] == ["run"] and "--no-report" not in args:
        args = [*args, "--no-report"]  # the closing report is tested on its own
    env = dict(os.environ, SHARDRL_CACHE=str(cwd / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "shardrl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY + f"tracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    return path


def summary(store: Path, run_id: str) -> dict:
    return json.loads((store / "runs" / run_id / "state" / "runner" / "summary.json").read_text())


def learner_metric(store: Path, run_id: str, name: str) -> list[float]:
    import pyarrow.parquet as pq

    values = []
    for f in sorted((store / "runs" / run_id / "metrics" / "learn").rglob("*.parquet")):
        t = pq.read_table(f)
        values += [v for n, v in zip(t.column("name").to_pylist(), t.column("value").to_pylist(),
                                     strict=True) if n == f"learn/{name}"]
    return values


def processes() -> list[tuple[int, list[bytes], str]]:
    """(pid, command line arguments, process name) of every process this user can read."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        found.append((int(proc.name), cmd, comm))
    return found


def stage_pids(name: str, run_id: str) -> list[int]:
    """Processes running stage NAME of run RUN_ID: started as `shardrl stage NAME ... --run-id
    RUN_ID`, or forked by that run's runner (named `stage:NAME`, with the runner's arguments).
    Tests run side by side (`make test` runs two at once), so the run id must be one of the
    arguments, not merely inside one."""
    from shardrl.orchestrate.fork import process_title

    return [pid for pid, cmd, comm in processes()
            if run_id.encode() in cmd  # an argument of its own: not part of a path or a setting
            and ((b"stage" in cmd and name.encode() in cmd) or comm == process_title(name))]
