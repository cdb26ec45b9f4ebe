"""`shardrl run`: the whole pipeline on one machine, stages as concurrent subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import ConfigError, RunConfig, load_config
from ..store import RunKeys, Store, open_store
from .graph import LOOPING, STAGES, entrypoint, stage


@dataclass
class Proc:
    name: str
    worker: int
    popen: subprocess.Popen
    log: Path
    restarts: int = 0
    exit_code: int | None = None


@dataclass
class LocalRun:
    cfg: RunConfig
    run_id: str
    store_uri: str
    store: Store
    log_dir: Path
    config_path: Path
    procs: list[Proc] = field(default_factory=list)

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    def command(self, name: str, worker: int) -> list[str]:
        spec = stage(name)
        argv = entrypoint(name, config=str(self.config_path), run_id=self.run_id,
                          store=self.store_uri, worker=worker, workers=spec.replicas(self.cfg))
        return [sys.executable, "-m", "shardrl.cli", *argv[1:]]

    def start(self, name: str, worker: int = 0) -> Proc:
        log = self.log_dir / (f"{name}.log" if worker == 0 else f"{name}-{worker}.log")
        env = dict(os.environ, SHARDRL_THREADS=str(stage(name).threads(self.cfg)),
                   OMP_NUM_THREADS=str(stage(name).threads(self.cfg)))
        handle = open(log, "a")  # noqa: SIM115 - owned by the child for its lifetime
        popen = subprocess.Popen(self.command(name, worker), stdout=handle, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        return Proc(name, worker, popen, log)

    def run_once(self, name: str) -> int:
        proc = self.start(name)
        return proc.popen.wait()

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                os.killpg(p.popen.pid, sig)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)


def prepare_run(args) -> LocalRun:
    if args.resume:
        run_id = args.resume
        store_uri = args.store or (load_config(args.config).store.uri if args.config else "runs")
        store = open_store(store_uri)
        keys = RunKeys(run_id)
        if not store.exists(keys.run_json()):
            raise SystemExit(f"--resume {run_id}: no run.json under {store_uri}/{keys.root}")
        cfg = RunConfig.model_validate(store.get_json(keys.run_json())["config"])
    else:
        if not args.config:
            raise SystemExit("shardrl run: give a CONFIG (file or preset) or --resume RUN_ID")
        cfg = load_config(args.config, args.overrides)
        store_uri = args.store or cfg.store.uri
        run_id = args.run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        store = open_store(store_uri)
    log_dir = (Path(store_uri) if "://" not in store_uri else Path(".shardrl")) / "runs" / run_id / "logs"
    if store_uri.startswith("file://"):
        log_dir = Path(store_uri[len("file://"):]) / "runs" / run_id / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return LocalRun(cfg, run_id, store_uri, store, log_dir, config_path)


def run(args) -> int:
    try:
        lr = prepare_run(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    from .monitor import Monitor

    monitor = Monitor(lr, progress_bar=not args.no_progress)
    print(f"run {lr.run_id}: store {lr.store_uri}, logs {lr.log_dir}", flush=True)
    interrupted = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal interrupted
        interrupted = True

    old = signal.signal(signal.SIGINT, on_signal), signal.signal(signal.SIGTERM, on_signal)
    try:
        if not lr.store.exists(lr.keys.run_json()):
            monitor.say("snapshot: building the initial policy (SFT to its plateau)")
            if lr.run_once("snapshot") != 0:
                print(f"snapshot failed: see {lr.log_dir / 'snapshot.log'}", file=sys.stderr)
                return 1
        for spec in STAGES:
            if spec.name in LOOPING:
                for w in range(spec.replicas(lr.cfg)):
                    lr.procs.append(lr.start(spec.name, w))
        code = supervise(lr, monitor, lambda: interrupted)
        if code != 0:
            return code
        monitor.finish_metrics()
        if lr.run_once("promote") != 0:
            print(f"promote failed: see {lr.log_dir / 'promote.log'}", file=sys.stderr)
            return 1
        return monitor.summary()
    finally:
        lr.stop_all()
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])


def supervise(lr: LocalRun, monitor, interrupted) -> int:
    """Restart crashed looping stages (bounded), until every one has exited cleanly."""
    while True:
        if interrupted():
            monitor.say("interrupted: stopping all stages (state is kept; resume with "
                        f"`shardrl run --resume {lr.run_id}`)")
            lr.stop_all()
            return 130
        running = 0
        for i, p in enumerate(lr.procs):
            code = p.popen.poll()
            if code is None:
                running += 1
                continue
            if code == 0 or p.exit_code == 0:
                p.exit_code = 0
                continue
            if p.restarts >= lr.cfg.pipeline.max_restarts:
                monitor.say(f"{p.name} failed {p.restarts + 1} times (exit {code}); "
                            f"see {p.log}. Stopping the run.")
                lr.stop_all()
                return 1
            monitor.say(f"{p.name} exited with {code}; restarting ({p.restarts + 1}/"
                        f"{lr.cfg.pipeline.max_restarts})")
            fresh = lr.start(p.name, p.worker)
            fresh.restarts = p.restarts + 1
            lr.procs[i] = fresh
            running += 1
        monitor.tick()
        if running == 0:
            return 0
        time.sleep(1.0)
