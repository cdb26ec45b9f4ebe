"""Start-up: the runner's warm-up, the task built once, and looping stages that start before
the snapshot and wait for it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardrl.config import load_config
from shardrl.orchestrate import local
from shardrl.store import LocalStore, RunKeys
from shardrl.tasks.source import make_task

FORK_AFTER_WARMUP = r"""
import os, sys, torch
from shardrl.config import load_config
from shardrl.orchestrate.fork import warm

torch.set_num_threads(2)
warm(load_config("demo"))  # what the runner does; raises if the warm-up started a thread
assert torch.get_num_threads() == 2, torch.get_num_threads()
pid = os.fork()
if pid == 0:  # the child's OpenMP must work: the parent has no pool for it to inherit
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(20):
        a = torch.tanh(a @ a / 512)
    os._exit(0 if torch.isfinite(a).all() else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_the_runners_warmup_starts_no_thread_and_a_forked_child_can_use_openmp():
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_WARMUP], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    # DeepSpeed, which transformers imports where it is installed, is told there is no GPU
    # rather than warning in every run's output that it found none
    assert "Setting accelerator to CPU" not in done.stdout + done.stderr, done.stdout[-2000:]
    # nor does the warm-up's throwaway model show progress bars there
    assert "Writing model shards" not in done.stderr and "Loading weights" not in done.stderr


LOAD_STARTS_NO_THREAD = r"""
import os, tempfile, threading
from transformers import AutoModelForCausalLM
from shardrl.models.io import SYNC_LOAD, load_causal_lm, save_model
from shardrl.models.tiny import tiny_lm

started = []
start = threading.Thread.start
threading.Thread.start = lambda self: (started.append(self.name), start(self))[1]
with tempfile.TemporaryDirectory() as folder:
    save_model(tiny_lm(vocab_size=12, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       hidden_size=8, num_layers=2, num_heads=2, intermediate_size=16,
                       max_position_embeddings=16, seed=0), None, folder)
    AutoModelForCausalLM.from_pretrained(folder)  # transformers' own default: a pool
    assert started, "from_pretrained no longer starts loading threads: drop SYNC_LOAD"
    started.clear()
    load_causal_lm(folder)
assert started == [], started
assert SYNC_LOAD not in os.environ  # the caller's environment is left as it was
"""


def test_loading_a_model_starts_no_thread():
    # transformers loads on a pool it shuts down without waiting for its threads, and the
    # runner and the learner fork right after loading a model
    done = subprocess.run([sys.executable, "-c", LOAD_STARTS_NO_THREAD], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_new_threads_waits_for_ending_threads_and_names_lasting_ones():
    from shardrl.orchestrate.warmup import new_threads, threads

    before = threads()
    brief = threading.Thread(target=time.sleep, args=(0.1,), name="brief")
    brief.start()
    assert new_threads(before, settle_s=2.0) == []  # it ended within the settling time
    stop = threading.Event()
    lasting = threading.Thread(target=stop.wait, name="lasting")
    lasting.start()
    try:
        extra = new_threads(before, settle_s=0.05)
        assert extra == [next(t for t in threads() if t.startswith(f"{lasting.native_id}:"))]
    finally:
        stop.set()
        lasting.join()


def test_the_task_is_built_once_per_process_and_task_settings():
    cfg = load_config("demo")
    first = make_task(cfg)
    assert make_task(load_config("demo")) is first  # an equal config: the same task
    other = make_task(load_config("demo", ["seed=7"]))
    assert other is not first
    assert [it.prompt for it in other.train_items(0, 0, 8)] != [
        it.prompt for it in first.train_items(0, 0, 8)]
    # settings outside the task section do not rebuild it
    assert make_task(load_config("demo", ["learner.lr=0.5"])) is first


def context(store: Path):
    from shardrl.stages.context import build_context

    args = argparse.Namespace(name="rollout", config="demo", overrides=[], store=str(store),
                              run_id="r1", worker=0, workers=1, once=False)
    return build_context(args)


def test_a_looping_stage_waits_for_run_json_then_goes_on(tmp_path):
    ctx = context(tmp_path)
    (tmp_path / "runs" / "r1").mkdir(parents=True)  # the runner's log folder is there
    waiter = threading.Thread(target=ctx.wait_for_run, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # no run.json: still waiting
    LocalStore(str(tmp_path)).put_json(RunKeys("r1").run_json(), {"run_id": "r1"})
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_the_runner_starts_the_looping_stages_before_the_snapshot(tmp_path, monkeypatch):
    started: list[str] = []
    seen_at_snapshot: list[list[str]] = []

    class Started:
        def __init__(self, name: str) -> None:
            self.name, self.popen = name, self

        def poll(self):
            return None

    def start(self, name, worker=0):
        started.append(name)
        return Started(name)

    def one_shot(lr, name):  # the snapshot fails at once: the run ends there
        seen_at_snapshot.append(list(started))
        return 1

    stopped = []
    monkeypatch.setattr(local.LocalRun, "start", start)
    monkeypatch.setattr(local.LocalRun, "stop_all", lambda self: stopped.append(True))
    monkeypatch.setattr(local, "one_shot", one_shot)
    args = argparse.Namespace(resume=None, config="demo",
                              overrides=["pipeline.local.fork=false", "tracking.enabled=false"],
                              store=str(tmp_path), run_id="r1", no_progress=True,
                              no_report=True, create_bucket=False)
    assert local.run(args) == 1
    assert seen_at_snapshot == [["rollout", "rollout", "learn", "evaluate"]]
    assert stopped  # and they are stopped with the run


class RunAwaited(Exception):
    """Raised in place of waiting for the run: the stage got as far as asking for it."""


def test_every_looping_stage_waits_for_the_run_before_it_reads_it(tmp_path, monkeypatch):
    """A looping stage does what needs no run (the learner forks its commit writer) and then
    waits for run.json itself, before it reads any of the run's state; here the wait raises
    instead, and a look at the store before it fails the test."""
    import importlib

    from shardrl.graph import STAGES
    from shardrl.stages.context import StageContext

    def awaited(self):
        raise RunAwaited(self.stage)

    preloaded: list[str] = []

    def preload(self):  # policy v0 may load first (its own test below): nothing else may
        preloaded.append(self.stage)

    monkeypatch.setattr(StageContext, "wait_for_run", awaited)
    monkeypatch.setattr(StageContext, "preload_policy", preload)
    looping = [s for s in STAGES if s.loops]
    assert {s.name for s in looping} >= {"rollout", "score", "prepare", "learn", "evaluate"}
    for spec in looping:
        ctx = context(tmp_path)
        ctx.stage = spec.name
        for name in ("get_bytes", "exists", "list", "watch"):

            def early(key, *args, _stage=spec.name, **kwargs):
                raise AssertionError(f"{_stage} looked at {key} before waiting for the run")

            monkeypatch.setattr(ctx.store, name, early)
        with pytest.raises(RunAwaited, match=f"^{spec.name}$"):
            importlib.import_module(spec.module).main(ctx)
    assert sorted(preloaded) == ["learn", "rollout"]  # the stages that train or sample v0


def publish_v0(tmp_path: Path, store: LocalStore, keys: RunKeys, seed: int) -> dict:
    """A tiny policy v0 uploaded as the snapshot uploads it (manifest last); its weights."""
    from shardrl.models.io import save_model
    from shardrl.models.tiny import build_tiny_model, train_tokenizer
    from shardrl.stages.snapshot import _upload

    folder = tmp_path / f"v0-{seed}"
    tokenizer = train_tokenizer(["abcdefghij"], folder / "tok")
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=32, seed=seed)
    save_model(model, tokenizer, folder / "model")
    _upload(store, keys.policy_prefix(0), folder / "model")
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_weights(model, weights: dict) -> bool:
    import torch

    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Model-file caches of these tests under their own folder."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_stage_loads_policy_v0_while_the_snapshot_still_evaluates_it(tmp_path, cache):
    """The snapshot uploads v0, evaluates it, then writes run.json: a stage started before
    loads v0 as soon as its manifest is there (reading nothing else of the run but whether
    run.json exists), and takes that model once the run exists."""
    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    looked: list[str] = []

    def spy(real):
        def call(key, *args, **kwargs):
            looked.append(key)
            return real(key, *args, **kwargs)
        return call

    for name in ("get_bytes", "exists", "list", "get_json"):
        setattr(ctx.store, name, spy(getattr(ctx.store, name)))
    got = []
    waiter = threading.Thread(target=lambda: got.append(ctx.preload_policy()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not got  # no v0 yet: waiting
    weights = publish_v0(tmp_path, store, keys, seed=0)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    base = got[0]
    assert not store.exists(keys.run_json())  # loaded before the run exists
    assert looked and all(k == keys.run_json() or k.startswith(keys.policy_prefix(0))
                          for k in looked), looked
    early = base.loaded[0]
    assert same_weights(early, weights)
    store.put_json(keys.run_json(), {"run_id": "r1"})
    model, tokenizer = base.take()
    assert model is early  # not loaded twice
    assert tokenizer.decode(tokenizer("abc")["input_ids"], skip_special_tokens=True) == "abc"
    assert base.loaded is None  # handed over, not kept
    ctx.close()


def test_the_wait_for_v0_wakes_when_its_manifest_lands(tmp_path, cache, monkeypatch):
    """The wait watches the policy's folder two levels below the run, created meanwhile: it
    wakes on the manifest's commit, not at its 1 s timeout."""
    from shardrl.stages.policy import BasePolicy

    monkeypatch.setattr(BasePolicy, "preload", lambda self: None)
    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    woke = []
    waiter = threading.Thread(target=lambda: (ctx.preload_policy(), woke.append(time.monotonic())),
                              daemon=True)
    waiter.start()
    time.sleep(0.3)
    store.put_bytes(keys.policy_prefix(0) + "config.json", b"{}")  # creates both folders
    time.sleep(0.85)  # past the first 1 s wait: a missed commit would now cost most of one
    assert waiter.is_alive()  # a file of v0 is not v0
    store.put_json(keys.policy_prefix(0) + "MANIFEST.json", {"files": {}})
    landed = time.monotonic()
    waiter.join(timeout=5)
    assert woke and woke[0] - landed < 0.5
    ctx.close()


def test_a_failed_early_load_leaves_v0_to_take(tmp_path, cache, monkeypatch):
    """An early load that fails (v0 being uploaded again under it) is not an error of the
    stage: `take` loads v0 once the run exists."""
    from shardrl.stages import policy

    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    weights = publish_v0(tmp_path, store, keys, seed=0)
    real = policy.load_policy

    def mismatched(*args, **kwargs):
        raise ValueError("model.safetensors: sha256 does not match the manifest")

    monkeypatch.setattr(policy, "load_policy", mismatched)
    base = ctx.preload_policy()
    assert base.loaded is None
    monkeypatch.setattr(policy, "load_policy", real)
    store.put_json(keys.run_json(), {"run_id": "r1"})
    model, _ = base.take()
    assert same_weights(model, weights)
    ctx.close()
    ctx.close()


def test_a_v0_published_again_before_run_json_is_loaded_again(tmp_path, cache):
    """A snapshot restarted before run.json uploads v0 again, maybe with other weights: the
    model loaded early from the first upload is not used."""
    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    first = publish_v0(tmp_path, store, keys, seed=0)
    base = ctx.preload_policy()
    early = base.loaded[0]
    assert same_weights(early, first)
    second = publish_v0(tmp_path, store, keys, seed=1)
    assert not same_weights(early, second)
    store.put_json(keys.run_json(), {"run_id": "r1"})
    model, _ = base.take()
    assert model is not early
    assert same_weights(model, second)
    ctx.close()


def test_a_stage_that_starts_after_the_snapshot_loads_v0_as_before(tmp_path, cache):
    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    weights = publish_v0(tmp_path, store, keys, seed=0)
    store.put_json(keys.run_json(), {"run_id": "r1"})
    base = ctx.preload_policy()
    assert base.loaded is None  # nothing early: the run was there
    model, _ = base.take()
    assert same_weights(model, weights)


def test_the_watches_a_stage_waited_on_at_start_stay_open_until_it_ends(tmp_path):
    """Closing an inotify watch waits for the kernel: the start-up waits hand theirs to the
    context, which closes them when the stage ends; a policy already published needs none."""
    ctx = context(tmp_path)
    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    waiter = threading.Thread(target=ctx.wait_for_run, daemon=True)
    waiter.start()
    time.sleep(0.2)
    store.put_json(keys.run_json(), {"run_id": "r1"})
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    kept = list(ctx._idle_watches)
    assert len(kept) == 1

    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(ctx.wait_for_policy(0.05)), daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got  # nothing published yet
    store.put_json(keys.latest_policy(), {"version": 0, "time": time.time()})
    waiter.join(timeout=5)
    assert got == [0]
    kept = list(ctx._idle_watches)
    assert len(kept) == 2

    def no_watch(*args, **kwargs):
        raise AssertionError("a published policy needs no watch")

    ctx.store.watch = no_watch
    assert ctx.wait_for_policy(0.05) == 0
    ctx.close()
    assert ctx._idle_watches == []
    assert all(getattr(w, "fd", -1) == -1 for w in kept)  # closed (inotify watches here)


def test_a_forked_stage_that_fails_masks_credentials_in_its_traceback(tmp_path, monkeypatch):
    """A library's error may quote an address with its credentials (MLflow's "API request to
    https://user:token@host failed"): the forked stage's traceback goes to its log masked,
    as a subprocess's does through its excepthook."""
    import io
    import sys

    import shardrl.cli
    from shardrl.orchestrate.fork import fork_stage

    def failing(argv):
        raise RuntimeError("API request to https://ci:hunter22@mlflow.example/api failed")

    monkeypatch.setattr(shardrl.cli, "main", failing)
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.FileIO(2, "w", closefd=False)))
    log = tmp_path / "stage.log"
    child = fork_stage(["stage"], log, {}, "failing", lambda: None)
    assert child.wait(timeout=30) == 1
    text = log.read_text()
    assert "RuntimeError: API request to https://***@mlflow.example/api failed" in text, text
    assert "hunter22" not in text
