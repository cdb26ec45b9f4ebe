"""Crash anywhere: SIGKILL looping stages at seeded random moments of a tiny run.

One run is disturbed by a schedule of kills that covers every looping stage (the learner
twice: once at a random moment, once the instant its ledger delta appears, before its
progress commit); the runner restarts each stage. The run must complete with exact
accounting, no shard consumed twice, continuous policy versions, and a final evaluation
within sampling noise of an undisturbed run with the same seed.

The helpers here drive the local runner for the other fault tests too (outage, resume).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardrl.orchestrate.local import restart_delay
from shardrl.store import RunKeys, Store, open_store

from .conftest import TINY, stage_pids

pytestmark = pytest.mark.slow

STEPS = 48
"""Long enough that the run cannot end before the last kill lands (a tiny step takes
milliseconds); every kill happens in the first third."""
SETTINGS = (f"learner.total_steps={STEPS}", "eval.every=12", "eval.samples_per_prompt=4",
            "pipeline.max_restarts=5")
LOOPING = ("rollout", "learn", "evaluate")
"""The looping stages of the tiny config: its rollout worker scores and prepares inline."""
STAGED = ("rollout", "score", "prepare", "learn", "evaluate")
"""The looping stages with `rollout.postprocess: stages` (the outage test runs so)."""


# -- driving the runner ---------------------------------------------------------------------
def write_config(tmp_path: Path, extra: str = "tracking: {enabled: false}\n") -> Path:
    """The tiny config (plus `extra` YAML) as a file."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY + extra)
    return path


def start_runner(tmp_path: Path, args: list[str], name: str,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`shardrl ARGS...` in the background, its output in a file; (process, output file)."""
    out = tmp_path / f"{name}.out"
    full = dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                **(env or {}))
    with open(out, "ab") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "shardrl.cli", *args], cwd=tmp_path,
                                env=full, stdout=handle, stderr=subprocess.STDOUT)
    return proc, out


def run_args(config: Path, store: str, run_id: str, *settings: str) -> list[str]:
    """Arguments of `shardrl run` for the fault runs."""
    return ["run", str(config), "--store", store, "--run-id", run_id, "--no-progress",
            "--no-report", *(x for s in (*SETTINGS, *settings) for x in ("--set", s))]


def finish(proc: subprocess.Popen, out: Path, timeout: float = 600) -> str:
    """Wait for the runner; its whole output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("run did not finish in time:\n" + out.read_text()[-4000:]) from None
    return out.read_text()


def wait_for(condition: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def progress(store: Store, run_id: str) -> dict:
    key = RunKeys(run_id).state("learn", "progress.json")
    return store.get_json(key) if store.exists(key) else {}


def version(store: Store, run_id: str) -> int:
    return int(progress(store, run_id).get("version", 0))


def kill_stage(name: str, run_id: str, timeout: float = 120) -> int:
    """SIGKILL the stage (waiting for it to be up, e.g. after a restart); its pid."""
    pid = wait_for(lambda: stage_pids(name, run_id), timeout, f"stage {name} to run")[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_learner_at_commit(store: Store, run_id: str, timeout: float = 120) -> bool:
    """SIGKILL the learner the instant its next ledger delta appears, i.e. inside its commit
    (after the ledger, before progress.json); whether progress still lagged when it died."""
    pid = wait_for(lambda: stage_pids("learn", run_id), timeout, "the learner to run")[0]
    keys = RunKeys(run_id)
    nxt = keys.state("learn", f"ledger-{int(progress(store, run_id).get('commits', 0)) + 1:06d}.json")
    wait_for(lambda: store.exists(nxt), timeout, f"{nxt}", poll=0.001)
    os.kill(pid, signal.SIGKILL)
    return int(progress(store, run_id).get("commits", 0)) < int(nxt[-11:-5])


# -- checking a finished run ----------------------------------------------------------------
def ledger(store: Store, run_id: str) -> list[dict]:
    keys = RunKeys(run_id)
    return [store.get_json(k) for k in store.list(keys.root + "state/learn/ledger-")]


def check_completed(store: Store, run_id: str, steps: int) -> dict:
    """Assert what every disturbed run must end with; the runner's summary."""
    keys = RunKeys(run_id)
    summary = store.get_json(keys.state("runner", "summary.json"))
    acc = summary["accounting"]
    assert acc["balanced"] and acc["duplicate_shards"] == [], acc
    assert acc["generated"] == (acc["consumed"] + acc["stale_dropped"] + acc["filtered"]
                                + acc["quarantined"] + acc["unconsumed"]), acc
    assert acc["unreadable_quarantined_shards"] == 0 and acc["consumed"] > 0
    assert summary["done"]["steps"] == steps
    deltas = ledger(store, run_id)
    shard_keys = [e["key"] for d in deltas for e in d["shards"]]
    assert len(shard_keys) == len(set(shard_keys)), "a shard was consumed twice"
    versions = [d["version"] for d in deltas]
    assert versions == sorted(versions) and versions[-1] == steps
    assert sorted(set(versions)) == list(range(versions[0], steps + 1)), "a version was skipped"
    # every commit number is there once: ledger-000001 ... ledger-N
    names = [k.rsplit("-", 1)[1] for k in store.list(keys.root + "state/learn/ledger-")]
    assert names == [f"{i:06d}.json" for i in range(1, len(names) + 1)]
    assert store.exists(keys.policy_file(steps, "MANIFEST.json"))
    assert store.get_json(keys.latest_policy())["version"] == steps
    return summary


def eval_samples(store: Store, run_id: str, version: int) -> dict[str, list[float]]:
    table = pq.read_table(io.BytesIO(store.get_bytes(RunKeys(run_id).eval_table(version))))
    return {"reward": table.column("reward").to_pylist(),
            "length": [float(n) for n in table.column("response_length").to_pylist()]}


def within_noise(a: list[float], b: list[float], z: float = 4.0) -> bool:
    """|mean(a) - mean(b)| <= z standard errors of the difference of two sample means
    (the bound is 0 when neither sample varies: the means must then be equal)."""
    def mean_var(x):
        m = sum(x) / len(x)
        return m, sum((v - m) ** 2 for v in x) / max(len(x) - 1, 1)

    (ma, va), (mb, vb) = mean_var(a), mean_var(b)
    return abs(ma - mb) <= z * math.sqrt(va / len(a) + vb / len(b)) + 1e-9


def test_within_noise_bound_by_hand():
    # means 1 and 2; each sample variance is (1 + 0 + 0 + 1) / 3 = 2/3 over 4 values, so the
    # standard error of the difference is sqrt(2/3 / 4 + 2/3 / 4) = 0.577: the gap of 1.0 is
    # within 2 SE (1.155) but not within 1 SE
    a, b = [0.0, 1.0, 1.0, 2.0], [1.0, 2.0, 2.0, 3.0]
    assert within_noise(a, b, z=2.0) and not within_noise(a, b, z=1.0)
    assert within_noise([0.0] * 8, [0.0] * 8) and not within_noise([0.0] * 8, [1.0] * 8)


def test_restart_backoff_doubles_up_to_its_cap():
    # 1 s before the first restart, doubling: 1, 2, 4, 8, 16, then 32 is capped at 30
    assert [restart_delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


# -- the runs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> tuple[Store, str, float]:
    tmp = tmp_path_factory.mktemp("undisturbed")
    store_path = str(tmp / "store")
    started = time.monotonic()
    proc, out = start_runner(tmp, run_args(write_config(tmp), store_path, "calm"), "calm")
    text = finish(proc, out)
    wall = time.monotonic() - started
    assert proc.returncode == 0, text[-4000:]
    # tracking off: the summary names the version promote chose, and no registry or MLflow
    chosen = (r"chosen version    policy v\d+ \(pass_at_1 [01]\.\d{3} ± 0\.\d{3}( confirmed on "
              r"fresh samples \([01]\.\d{3} when chosen\))?; tracking is off")
    assert re.search(chosen, text), text[-3000:]
    assert "registered model" not in text and "MLflow  " not in text
    return open_store(store_path), "calm", wall


def test_crash_anywhere_loses_and_doubles_nothing(tmp_path, undisturbed):
    store_path = str(tmp_path / "store")
    store = open_store(store_path)
    run_id = "crashy"
    rng = random.Random(7)
    # both rollout workers' turn may come (a kill takes the first one found), the learner twice
    schedule = [*LOOPING, "rollout", "learn@commit"]
    rng.shuffle(schedule)
    # kills in the first third, so that the run cannot end before the last one lands
    thresholds = sorted(rng.sample(range(1, STEPS // 3 + 1), len(schedule)))
    started = time.monotonic()
    proc, out = start_runner(tmp_path, run_args(write_config(tmp_path), store_path, run_id), run_id)
    killed, inside_commit = [], None
    for target, at in zip(schedule, thresholds, strict=True):
        wait_for(lambda at=at: version(store, run_id) >= at, 300, f"learner version {at}")
        if target == "learn@commit":
            inside_commit = kill_learner_at_commit(store, run_id)
            killed.append("learn")
        else:
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment of its work
            kill_stage(target, run_id)
            killed.append(target)
    text = finish(proc, out)
    wall = time.monotonic() - started
    assert proc.returncode == 0, text[-4000:]
    for name in set(killed):
        assert text.count(f"{name} exited with -9; restarting") == killed.count(name), text
    summary = check_completed(store, run_id, STEPS)
    assert not store.exists(RunKeys(run_id).taken())  # no worker reads takes by default
    calm_store, calm_id, calm_wall = undisturbed
    calm = check_completed(calm_store, calm_id, STEPS)
    # the final policy evaluates like the undisturbed one, within sampling noise
    for metric in ("reward", "length"):
        ours = eval_samples(store, run_id, STEPS)[metric]
        theirs = eval_samples(calm_store, calm_id, STEPS)[metric]
        assert within_noise(ours, theirs), (metric, ours, theirs)
    acc = summary["accounting"]
    print(json.dumps({"faults": len(killed), "killed": killed, "inside_commit": inside_commit,
                      "generated": acc["generated"], "lost": acc["generated"] - sum(
                          acc[k] for k in ("consumed", "stale_dropped", "filtered", "quarantined",
                                           "unconsumed")),
                      "duplicated": len(acc["duplicate_shards"]), "wall_s": round(wall, 1),
                      "undisturbed_wall_s": round(calm_wall, 1),
                      "undisturbed_generated": calm["accounting"]["generated"]}))


ARRANGED = """tracking: {enabled: false}
rollout: {lead_counted_at: take, standby: {workers: 1, start: 0.2, stop: 0.05, window_steps: 2}}
pipeline: {local: {weights_channel: true, nice: {rollout: 5, evaluate: 10, rollout.1: 19}}}
"""
"""The lead counted from the take, worker 1 standing by (called in early), new weights through
the runner's channel: the learner's restart must empty the channel and nothing is lost."""


def test_crash_anywhere_with_the_lead_from_the_take_and_the_weights_channel(tmp_path):
    store_path = str(tmp_path / "store")
    store = open_store(store_path)
    run_id = "arranged"
    # a worker twice, the learner at a random moment and the instant its ledger delta
    # appears (its weights already in the channel, its commit not landed)
    schedule = ["rollout", "learn@commit", "rollout", "learn"]
    thresholds = [3, 6, 9, 12]
    arranged = tmp_path / "arranged.yaml"  # its `rollout:` merged over the tiny config's
    arranged.write_text(f"extends: {write_config(tmp_path, '')}\n{ARRANGED}")
    proc, out = start_runner(tmp_path, run_args(arranged, store_path, run_id), run_id)
    for target, at in zip(schedule, thresholds, strict=True):
        wait_for(lambda at=at: version(store, run_id) >= at, 300, f"learner version {at}")
        if target == "learn@commit":
            kill_learner_at_commit(store, run_id)
        else:
            time.sleep(0.1)
            kill_stage(target, run_id)
    text = finish(proc, out)
    assert proc.returncode == 0, text[-4000:]
    assert text.count("learn exited with -9; restarting") == 2, text
    check_completed(store, run_id, STEPS)
    keys = RunKeys(run_id)
    taken = store.get_json(keys.taken())  # the learner recorded its takes
    assert sum(taken["kept_groups_by_worker"].values()) > 0
    logs = Path(store_path) / "runs" / run_id / "logs"
    assert "generating: the learner waited for data" in (logs / "rollout-1.log").read_text()
    # the workers ran with the channel (how many versions they took from it depends on the
    # host's timing: `PolicyEngine.take` has its unit test), and the runner removed it
    folders = {Path(folder) for log in logs.glob("rollout*.log")
               for folder in re.findall(r"versions from the weights channel: \d+ \(the others "
                                        r"from the store; the channel (\S+)\)", log.read_text())}
    assert len(folders) == 1, folders
    assert not folders.pop().exists()
