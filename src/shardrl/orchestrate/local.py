"""`shardrl run`: the whole pipeline on one machine, stages as concurrent subprocesses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, RunConfig, load_config
from ..config.loader import dump_yaml
from ..graph import active, after_loop, before_loop, entrypoint, stage
from ..lifetime import die_with_parent, process_identity, still_running
from ..redact import redacted
from ..stages import EXIT_CONFIG, EXIT_STORE_UNAVAILABLE
from ..stages import channel as weights_channel
from ..stages.context import release_cache, retry_policy
from ..stages.cores import CORES_ENV, SHARE_ENV
from ..store import (
    LocalStore,
    NotFound,
    RunKeys,
    Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from ..store.base import json_bytes
from ..store.keys import new_run_id
from ..store.records import Aborted, recorded_config
from ..tracking.mlflow_run import RunIdTaken, TrackingUnavailable
from .fork import Forked, fork_stage
from .rss import PeakRss, record

RESTART_BACKOFF_S = (1.0, 30.0)
"""First and largest delay before restarting a crashed stage; doubles per restart."""


def restart_delay(restarts: int) -> float:
    """Seconds to wait before restart number `restarts + 1` of one stage: 1, 2, 4, ... 30."""
    first, cap = RESTART_BACKOFF_S
    return min(cap, first * 2.0 ** restarts)


@dataclass
class Proc:
    name: str
    worker: int
    popen: subprocess.Popen | Forked
    log: Path
    restarts: int = 0
    exit_code: int | None = None
    restart_at: float | None = None
    """monotonic time of a scheduled restart (the backoff), None when none is due."""


@dataclass
class LocalRun:
    cfg: RunConfig
    run_id: str
    store_uri: str
    store: Store
    log_dir: Path
    config_path: Path
    procs: list[Proc] = field(default_factory=list)
    rss: PeakRss = field(default_factory=PeakRss)
    """Peak resident memory per stage, sampled while the stages run."""
    channel: Path | None = None
    """The weights channel's folder (`pipeline.local.weights_channel`), while the run runs."""
    new: bool = False
    """Whether the store held nothing of this run id when the runner started (its own logs
    aside): no MLflow run may be tagged with the id yet."""
    interrupted: Callable[[], bool] = lambda: False
    """Whether Ctrl-C or SIGTERM reached the runner (`run` sets it)."""

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    def command(self, name: str, worker: int) -> list[str]:
        spec = stage(name)
        argv = entrypoint(name, config=str(self.config_path), run_id=self.run_id,
                          store=self.store_uri, worker=worker, workers=spec.replicas(self.cfg),
                          ranks=spec.ranks(self.cfg))
        # this interpreter runs the console scripts, so the venv need not be on PATH
        module = {"shardrl": "shardrl.cli", "torchrun": "torch.distributed.run"}[argv[0]]
        return [sys.executable, "-m", module, *argv[1:]]

    def placement(self, name: str, worker: int = 0) -> tuple[dict[str, str], set[int] | None]:
        """(environment, CPU affinity or None) of replica `worker` of a stage: its threads,
        its pinned cores, or the shared-core directory through which busy stages borrow idle
        cores."""
        threads = str(stage(name).threads(self.cfg))
        # Several stages share these cores: OpenMP threads that spin while they wait for
        # work (the default) steal the cores another stage computes on, which made an update
        # up to 5x slower here; passive waiting yields them.
        env = {"SHARDRL_THREADS": threads, "OMP_NUM_THREADS": threads,
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"}
        if self.channel is not None:
            env[weights_channel.ENV] = str(self.channel)
        local = self.cfg.pipeline.local
        pinned = local.placed("cores", name, worker)
        if pinned is not None:
            here = set(pinned) & machine_cores()
            if here != set(pinned):
                print(f"pipeline.local.cores: {name} worker {worker} is pinned to cores "
                      f"{sorted(pinned)}; not available here (the runner's cpuset or "
                      f"online cores): {', '.join(map(str, sorted(set(pinned) - here)))}"
                      + ("" if here else ": it runs unpinned"), file=sys.stderr, flush=True)
            if here:
                return env, here
        if local.share_cores:
            share = self.log_dir / "cores"
            share.mkdir(exist_ok=True)
            env |= {SHARE_ENV: str(share), CORES_ENV: str(len(os.sched_getaffinity(0)))}
        return env, None

    def start(self, name: str, worker: int = 0) -> Proc:
        """Start one replica of stage `name` in a process group of its own (so that stopping
        it reaches its children), inside the runner's session, reading nothing from the
        runner's terminal (a background group that read it would be stopped).

        Not a session of its own: Linux's autogroup scheduling (on by default in most
        distributions' kernels) gives every session one equal share of the CPU and applies
        niceness only between the tasks of one session, so stages in sessions of their own
        would share the cores equally whatever `pipeline.local.nice` says.
        """
        log = self.log_dir / (f"{name}.log" if worker == 0 else f"{name}-{worker}.log")
        env, cpus = self.placement(name, worker)
        nice = self.cfg.pipeline.local.placed("nice", name, worker) or 0
        die = die_with_parent()

        def preexec() -> None:
            if die is not None:
                die()
            if cpus is not None:  # before exec: every thread of the stage inherits it
                try:
                    os.sched_setaffinity(0, cpus)
                except OSError:  # online, but outside the cores this container may use
                    os.write(2, f"pipeline.local.cores: cores {sorted(cpus)} are not "
                                "available here: this stage runs unpinned\n".encode())
            if nice:
                os.nice(nice)

        command = self.command(name, worker)
        if self.cfg.pipeline.local.fork and command[2] == "shardrl.cli":
            return Proc(name, worker, fork_stage(command[3:], log, env, name, preexec), log)
        with open(log, "a") as handle:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle,
                                     stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                                     process_group=0, preexec_fn=preexec)
        return Proc(name, worker, popen, log)

    def run_once(self, name: str) -> int:
        """Run stage `name` to its end; EXIT_INTERRUPTED once `interrupted` says so (the
        stage stopped as the looping ones are: its own process group gets no terminal
        signal)."""
        proc = self.start(name)
        while True:  # sample its memory while it runs: /proc forgets a process on exit
            self.sample_rss([proc])
            if self.interrupted():
                self.stop([proc])
                return EXIT_INTERRUPTED
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.popen.wait(timeout=0.5)
                self.sample_rss([proc])  # a forked stage's exact CPU time, now it is reaped
                return code

    def sample_rss(self, procs: list[Proc]) -> None:
        """Memory and CPU time of the running stages (exact CPU time of reaped forked ones)."""
        self.rss.sample((p.name, p.worker, p.popen.pid) for p in procs if p.popen.poll() is None)
        for p in procs:
            if getattr(p.popen, "cpu_s", None) is not None:
                self.rss.exited(p.name, p.popen.pid, p.popen.cpu_s)

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        self.stop(self.procs, sig)

    @staticmethod
    def stop(procs: list[Proc], sig: int = signal.SIGTERM) -> None:
        """Signal each stage's process group, then SIGKILL what is left after 10 s."""
        for p in procs:
            if p.popen.poll() is None:
                _signal(p.popen.pid, sig)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):  # reaped: a zombie counts
                    p.popen.wait(timeout=5)  # as running, and its model cache would stay


def finished(store: Store, keys: RunKeys) -> bool:
    """Whether the run has nothing left to do: the learner is done, promote has chosen its
    version and the runner wrote the run's summary with every metric in MLflow (a resume
    sends MLflow what it lacks)."""
    summary = keys.state("runner", "summary.json")
    return (store.exists(keys.done()) and store.exists(keys.state("promote", "result.json"))
            and store.exists(summary)
            and store.get_json(summary).get("mlflow_complete") is not False)


def prepare_run(args) -> LocalRun:
    for run_id in (args.resume, args.run_id):
        if run_id is not None:
            try:
                RunKeys(run_id)
            except ValueError as exc:
                raise SystemExit(f"shardrl run: {exc}") from None
    if args.resume:
        ignored = [flag for flag, given in (("--set", args.overrides), ("--run-id", args.run_id),
                                            ("--create-bucket", getattr(args, "create_bucket",
                                                                        False))) if given]
        if ignored:  # the run goes on under the config it started with (its run.json)
            raise SystemExit(
                f"shardrl run: --resume continues run {args.resume} with the config it started "
                f"with, so {', '.join(ignored)} would be ignored; drop "
                f"{'it' if len(ignored) == 1 else 'them'} (`shardrl replay` trains a copy "
                f"under changed settings)")
        run_id = args.resume
        store_uri = args.store or (load_config(args.config).store.uri if args.config else "runs")
        if args.config:
            use = "is not used" if args.store else "only tells the store"
            print(f"--resume {run_id}: the run keeps the config it started with; "
                  f"{args.config} {use}", file=sys.stderr)
        store = open_store(store_uri)
        keys = RunKeys(run_id)
        if not store.exists(keys.run_json()):
            refuse_if_in_use(store, keys, store_uri)  # a run still in its snapshot
            if store.exists(started_key(keys)):
                saved = run_log_dir(store_uri, run_id) / "config.yaml"
                raise SystemExit(
                    f"--resume {run_id}: the run stopped before its snapshot finished (no "
                    f"run.json under {store_uri}/{keys.root}); start it again with `shardrl run "
                    f"{saved if saved.exists() else 'CONFIG'} --run-id {run_id}"
                    + (f" --store {args.store}" if args.store else "") + "`")
            raise SystemExit(f"--resume {run_id}: no run.json under {store_uri}/{keys.root}")
        if finished(store, keys):
            # its stages would start, find everything done and end, and the run's summary
            # (peak memory, CPU) would be rewritten with those seconds' figures
            raise SystemExit(
                f"--resume {run_id}: the run has finished (the learner is done, promote has "
                f"chosen its version and MLflow has its metrics): nothing to resume. `shardrl "
                f"report {run_id}` shows it again; `shardrl replay` trains a copy under "
                "changed settings")
        cfg = RunConfig.model_validate(recorded_config(store, keys.run_json()))
        store = open_store(store_uri, retry_policy(cfg))
    else:
        if not args.config:
            raise SystemExit("shardrl run: give a CONFIG (file or preset) or --resume RUN_ID")
        cfg = load_config(args.config, args.overrides)
        store_uri = args.store or cfg.store.uri
        # the time, and a suffix for two runs started in the same second
        run_id = args.run_id or new_run_id(cfg.name)
        store = open_store(store_uri, retry_policy(cfg))
        if getattr(args, "create_bucket", False) and hasattr(store, "create_bucket"):
            if store.create_bucket():
                print(f"created bucket {store.bucket!r} at {store.endpoint}", flush=True)
        keys = RunKeys(run_id)
        if store.exists(keys.run_json()):  # starting it again would mix two configs in one run
            if finished(store, keys):
                raise SystemExit(f"shardrl run: run {run_id} already exists in {store_uri} and "
                                 f"has finished (`shardrl report {run_id}` shows it); pick "
                                 "another --run-id")
            raise SystemExit(
                f"shardrl run: run {run_id} already exists in {store_uri}; continue it with "
                f"`shardrl run --resume {run_id}"
                + (f" --store {args.store}" if args.store else "") + "`, or pick another --run-id")
    logs = keys.root + "logs/"  # a folder store's runner logs live under the run's root
    new = not args.resume and not any(not k.startswith(logs) for k in store.list(keys.root))
    claim(store, keys, store_uri)  # before anything of this runner's is written
    if args.resume:  # the abort marker moves aside only once the run is this runner's
        clear_abort(store, keys)
    log_dir = run_log_dir(store_uri, run_id)
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / "config.yaml"
    config_path.write_text(dump_yaml(cfg.model_dump(mode="json")))
    return LocalRun(cfg, run_id, store_uri, store, log_dir, config_path, new=new)


def run_log_dir(store_uri: str, run_id: str) -> Path:
    """Where the local runner keeps run `run_id`'s logs and resolved config: under the run's
    root in a folder store, under `.shardrl/` of the working folder for S3."""
    if store_uri.startswith("file://"):
        return Path(store_uri[len("file://"):]) / "runs" / run_id / "logs"
    return (Path(store_uri) if "://" not in store_uri else Path(".shardrl")) / "runs" / run_id / "logs"


EXIT_INTERRUPTED = 130
"""The runner's exit status after Ctrl-C or SIGTERM (the shell's for SIGINT)."""


def _signal(pid: int, sig: int) -> None:
    """Signal the process group of stage `pid`; a stage forked a moment ago may not have
    made its group yet (only the child calls setpgid), then the process alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def started_key(keys: RunKeys) -> str:
    """The runner's mark that it started run `keys.run_id` (and may create its MLflow run),
    written before anything else of the run (`claim`): a run stopped before its snapshot wrote
    anything is then started again under its own id, not refused as an earlier run's."""
    return keys.state("runner", "started.json")


def claim(store: Store, keys: RunKeys, store_uri: str) -> None:
    """Mark run `keys.run_id` as this runner's (`started_key`: its host and pid), or exit
    with a one-line error while a live runner on this machine holds it: two runners on one
    run would write over each other's config and state. The mark is created only if absent
    (atomically where the store can), so of two runners started at once one wins. A mark
    left by a runner that has ended (or from another machine, which cannot be checked) is
    taken over, by one runner of this machine only: the one that creates the takeover record
    named after that mark's bytes (`takeover_key`), also only if absent. Another resumer
    racing for the same mark finds the record and is refused while its runner lives; should
    that runner have stopped before it wrote its own mark, its record is taken over the same
    way. A runner on another machine cannot be checked, so its mark or record never refuses
    (nor does any on a store without conditional writes)."""
    key = started_key(keys)
    mine = json_bytes({"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                       "process": process_identity(os.getpid())})
    held = key  # the record of the runner that holds the run
    for _ in range(MAX_TAKEOVERS):
        if held == key and store.put_if_absent(key, mine):
            return
        try:
            record = store.get_bytes(held)
        except NotFound:  # the mark was removed meanwhile (its run never started)
            held = key
            continue
        if record == mine:  # this runner's own write, whose answer was lost (S3 retried it)
            if held != key:
                store.put_bytes(key, mine)
            return
        refuse_if_held(record, keys, store_uri)
        taken = takeover_key(keys, record)
        if store.put_if_absent(taken, mine):
            store.put_bytes(key, mine)
            return
        held = taken  # another runner took this mark over first
    raise SystemExit(f"shardrl run: run {keys.run_id} in {store_uri} changed hands "
                     f"{MAX_TAKEOVERS} times while this runner tried to take it; try again")


MAX_TAKEOVERS = 16
"""Takeover records `claim` follows before it gives up (each is a runner that took the run
over and ended before this one looked)."""


def takeover_key(keys: RunKeys, record: bytes) -> str:
    """The record that says which runner took over the holder whose record is `record`."""
    return keys.state("runner", f"takeover-{hashlib.sha256(record).hexdigest()[:16]}.json")


def refuse_if_in_use(store: Store, keys: RunKeys, store_uri: str) -> None:
    """Exit with a one-line error when a live runner on this machine holds the run's mark."""
    try:
        record = store.get_bytes(started_key(keys))
    except StoreError:  # none (NotFound), or unreadable: no runner to refuse for
        return
    refuse_if_held(record, keys, store_uri)


def refuse_if_held(record: bytes, keys: RunKeys, store_uri: str) -> None:
    """Exit with a one-line error when `record` (a runner's mark) names a live runner on this
    machine other than this one; an unreadable record names none."""
    try:
        other = json.loads(record)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(other, dict):
        return
    pid = other.get("pid")
    # a pid alone could be another process's by now (reused after the runner ended, or pid
    # 1 of a later container): the mark's process identity tells them apart
    if (other.get("host") == socket.gethostname() and isinstance(pid, int)
            and pid != os.getpid() and still_running(pid, other.get("process"))):
        raise SystemExit(f"shardrl run: run {keys.run_id} in {store_uri} is in use by the "
                         f"runner with process id {pid} on this machine; wait for it or stop "
                         f"it first (a new run can take another --run-id instead)")


def clear_abort(store: Store, keys: RunKeys) -> None:
    """Resuming an aborted run: move its abort marker under state/runner/, so the looping
    stages do not stop on it at once (and the run does not end as if finished)."""
    marker = Aborted.read(store, keys.aborted(), optional=True)
    if marker is None:
        return
    kept = keys.state("runner", f"aborted-{int(marker.time * 1000)}.json")
    marker.write(store, kept)
    store.delete(keys.aborted())
    print(f"resuming a run that was aborted ({marker.describe()}); its marker moved to {kept}",
          flush=True)


def one_shot(lr: LocalRun, name: str) -> int:
    """Run a stage that runs once; on failure say where its log is and return the exit code
    the runner ends with (1, the store-unavailable status, or EXIT_INTERRUPTED)."""
    code = lr.run_once(name)
    if code == EXIT_INTERRUPTED:
        if lr.store.exists(lr.keys.run_json()):
            print(f"interrupted: {name} stopped (state is kept; resume with {resume_hint(lr)})",
                  file=sys.stderr)
        else:  # nothing to resume from yet: the same run again, from its resolved config
            print(f"interrupted: {name} stopped before the run existed; start it again with "
                  f"{restart_hint(lr)}", file=sys.stderr)
        return code
    if code != 0:
        log = lr.log_dir / f"{name}.log"
        print(f"{name} failed (exit {code}){last_error(log)}: see {log}", file=sys.stderr)
        return code if code == EXIT_STORE_UNAVAILABLE else 1
    return 0


class UserCodeMissing(Exception):
    """A verifier or environment given as `package.module:name` whose module is not found."""


def find_user_code(cfg: RunConfig) -> None:
    """The modules of the verifiers and environment given as dotted paths are on this
    machine's import path, where the stages will look for them (found without running any
    of their code): a typo is said before the snapshot spends its time, not after it by
    rollout workers failing over and over. Only a module found missing is refused: where the
    search cannot tell (a finder that needs the package imported), the stages find out."""
    from ..config.data import DOTTED

    named = [("verifier", v.name) for v in cfg.reward.verifiers]
    named += [("environment", cfg.task.environment)] if cfg.task.environment else []
    for kind, name in named:
        if DOTTED.match(name) and (missing := _missing_module(name.partition(":")[0])):
            raise UserCodeMissing(
                f"shardrl run: cannot load {kind} {name!r}: no module named {missing!r} on the "
                f"import path here (install it or set PYTHONPATH)")


def _missing_module(module: str) -> str | None:
    """The first package or module of dotted `module` that is certainly not on the import
    path, else None. The top level is asked of every finder (an editable install's too);
    the rest is looked up in its parent's folders, nothing imported."""
    import importlib.machinery
    import importlib.util

    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    for i in range(1, len(parts) + 1):
        if spec is None:
            return ".".join(parts[:i])
        where = spec.submodule_search_locations
        if i == len(parts) or where is None:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), list(where))
        except Exception:  # a namespace package's parent not imported: cannot tell here
            return None
    return None


def run(args) -> int:
    """`shardrl run`. Ctrl-C and SIGTERM are noted from the first moment: one during the
    start-up (the libraries' loading and warm-up take seconds) ends the runner once it can
    stop cleanly, instead of a KeyboardInterrupt that a library's code may swallow (the run
    then went on to its end)."""
    interrupted = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal interrupted
        interrupted = True

    old = signal.signal(signal.SIGINT, on_signal), signal.signal(signal.SIGTERM, on_signal)
    try:
        return _run(args, lambda: interrupted)
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])


def _run(args, interrupted: Callable[[], bool]) -> int:
    from .monitor import Monitor

    try:
        lr = prepare_run(args)
        try:
            find_user_code(lr.cfg)
            monitor = Monitor(lr, progress_bar=not args.no_progress, brief_start=True)
        except (RunIdTaken, TrackingUnavailable, UserCodeMissing):  # this run never
            if lr.new:  # started: leave no mark, nor its resolved config
                lr.store.delete(started_key(lr.keys))
                lr.config_path.unlink(missing_ok=True)
                for folder in (lr.log_dir, lr.log_dir.parent):  # logs/, then the run's own
                    with contextlib.suppress(OSError):  # not empty: something else is there
                        folder.rmdir()
            raise
    except (ConfigError, RunIdTaken, UserCodeMissing) as exc:
        print(exc, file=sys.stderr)
        return 1
    except TrackingUnavailable as exc:
        print(f"shardrl run: {exc}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:
        print(f"shardrl run: {exc}", file=sys.stderr)
        return EXIT_STORE_UNAVAILABLE
    except (StoreError, OSError) as exc:
        # a missing bucket, rejected credentials, a URI naming no store, a folder store's
        # path that is a file or cannot be written: one line
        print(f"shardrl run: {exc}", file=sys.stderr)
        return 1
    print(f"run {lr.run_id}: store {lr.store_uri}, logs {lr.log_dir}", flush=True)
    if interrupted():
        return interrupted_at_start(lr)
    if lr.cfg.pipeline.local.fork:
        from ..tasks.datasets import DatasetError
        from .fork import warm

        try:
            warm(lr.cfg)  # the stages' imports, once: every stage is forked from here
        except DatasetError as exc:  # a missing or malformed task file: one line, not a trace
            print(f"shardrl run: {exc}", file=sys.stderr)
            return 1
    if interrupted():
        return interrupted_at_start(lr)
    lr.interrupted = interrupted
    if lr.cfg.pipeline.local.weights_channel:
        lr.channel, channel_lock = open_channel()
    try:
        if isinstance(lr.store, LocalStore):  # before any stage of the run writes
            count, size = lr.store.sweep_temp(lr.keys.root)
            if count:
                print(f"removed {count} temporary file(s), {size / 2**20:.1f} MiB, left by "
                      f"writes that were killed mid-write", flush=True)
        fresh = not lr.store.exists(lr.keys.run_json())  # run.json ends the stages before the loop
        # the looping stages start first and wait for run.json: their start-up (forking or
        # importing, the store, the config) overlaps the snapshot instead of following it
        for spec in active(lr.cfg):
            if spec.loops:
                for w in range(spec.replicas(lr.cfg)):
                    lr.procs.append(lr.start(spec.name, w))
        if fresh:
            for spec in before_loop(lr.cfg):
                monitor.say(f"{spec.name}: {spec.description}")
                if (code := one_shot(lr, spec.name)) != 0:
                    return code
        cpu_started = time.process_time()
        code = supervise(lr, monitor, interrupted)
        lr.rss.runner_cpu_s = time.process_time() - cpu_started
        if code != 0:
            return code
        if not lr.store.exists(lr.keys.done()):  # every stage ended, yet the run is not done
            marker = Aborted.read(lr.store, lr.keys.aborted(), optional=True)
            monitor.say("the looping stages stopped before the run was done" +
                        (f": run aborted: {marker.describe()}" if marker else
                         f"; see {lr.log_dir}") + f" (resume with {resume_hint(lr)}; "
                        f"`shardrl doctor {lr.run_id} --store {lr.store_uri}` reads its "
                        f"metrics)")
            return 1
        monitor.finish_metrics()
        for spec in after_loop(lr.cfg):
            if (code := one_shot(lr, spec.name)) != 0:
                return code
        code = monitor.summary()
        print(record(lr.store, lr.keys, lr.rss), flush=True)
        if args.no_report:
            return code
        report = subprocess.run([sys.executable, "-m", "shardrl.cli", "report", lr.run_id,
                                 "--store", lr.store_uri], capture_output=True, text=True)
        print((report.stdout or report.stderr).strip())
        return code
    except StoreUnavailable as exc:
        return store_down(lr, monitor, exc)
    finally:
        lr.stop_all()
        release_cache(lr.run_id)  # what stages killed before their end left behind
        if lr.channel is not None:
            shutil.rmtree(lr.channel, ignore_errors=True)
            os.close(channel_lock)


def open_channel() -> tuple[Path | None, int | None]:
    """The run's weights channel folder and the descriptor of its lock (`stages.channel`);
    (None, None), with a warning, where no folder can be made: the channel is only a
    shortcut, and the run goes on without it."""
    try:
        return weights_channel.make()
    except OSError as exc:
        print(f"pipeline.local.weights_channel: no folder for it ({exc}); new weights reach "
              "the rollout workers through the store alone", file=sys.stderr, flush=True)
        return None, None


def machine_cores(proc: Path = Path("/proc"), sys_fs: Path = Path("/sys")) -> set[int]:
    """The cores a stage of this runner may be pinned to: those of the runner's cpuset
    (cgroup v2 or v1: a container's `--cpuset-cpus`), else the machine's online cores. A
    pin may name one outside the runner's own affinity (`taskset`): the cpuset bounds it."""
    for path in _cpuset_files(proc, sys_fs):
        try:
            return cpu_list(path.read_text())
        except (OSError, ValueError):
            continue
    return set(range(os.cpu_count() or 1))


def _cpuset_files(proc: Path, sys_fs: Path) -> list[Path]:
    """Where the runner's usable cores are listed, most specific first."""
    files = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        group = group.lstrip("/")
        if controllers == "":  # v2: one hierarchy
            files.append(sys_fs / "fs" / "cgroup" / group / "cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):
            files.append(sys_fs / "fs" / "cgroup" / "cpuset" / group / "cpuset.effective_cpus")
    return [*files, sys_fs / "devices" / "system" / "cpu" / "online"]


def cpu_list(text: str) -> set[int]:
    """The cores of a kernel CPU list such as `0-3,8,10-11`."""
    cores: set[int] = set()
    for span in text.strip().split(","):
        first, _, last = span.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return cores


def last_error(log: Path, tail_bytes: int = 16384) -> str:
    """`: <the last error of a stage's log>`: the exception line of its last traceback, or its
    last line logged at ERROR or CRITICAL, whichever comes later, cut to 300 characters; ""
    when there is none."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    found, in_traceback = None, False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            found, in_traceback = line.strip(), False  # the exception the frames end in
        elif " ERROR " in line or " CRITICAL " in line:
            found = line.strip()
    if not found:
        return ""
    found = redacted(found)  # a library's error may quote an address with its credentials
    return ": " + (found if len(found) <= 300 else found[:297] + "...")


def resume_hint(lr: LocalRun) -> str:
    return f"`shardrl run --resume {lr.run_id} --store {lr.store_uri}`"


def interrupted_at_start(lr: LocalRun) -> int:
    """Ctrl-C or SIGTERM while the runner started up, before any stage: say how to go on."""
    if lr.store.exists(lr.keys.run_json()):
        print(f"interrupted before any stage started (state is kept; resume with "
              f"{resume_hint(lr)})", file=sys.stderr)
    else:
        print(f"interrupted before the run started; start it again with {restart_hint(lr)}",
              file=sys.stderr)
    return EXIT_INTERRUPTED


def restart_hint(lr: LocalRun) -> str:
    """The command that starts run `lr` again under its id with the config it resolved (its
    `logs/config.yaml`: the overrides included)."""
    return f"`shardrl run {lr.config_path} --run-id {lr.run_id} --store {lr.store_uri}`"


def store_down(lr: LocalRun, monitor, exc: BaseException) -> int:
    """Stop every stage and fail the run: the store stayed down past the retry deadline."""
    lr.stop_all()
    monitor.say(f"object store {lr.store_uri} unreachable for longer than "
                f"store.retry.deadline_s = {lr.cfg.store.retry.deadline_s:g} s ({exc}). "
                f"Stopping the run; its state is kept in the store: once the store is back, "
                f"continue with {resume_hint(lr)}")
    return EXIT_STORE_UNAVAILABLE


def abort(lr: LocalRun, p: Proc, code: int, reason: str | None = None) -> None:
    """Write the run's abort marker for stage `p`, out of restarts unless `reason` says
    otherwise: every looping stage stops on it, also one this runner does not own (a stage
    started by hand, say)."""
    reason = (reason or f"out of restarts (pipeline.max_restarts = "
              f"{lr.cfg.pipeline.max_restarts})") + f"; see {p.log}"
    Aborted(stage=p.name, worker=p.worker, exit_code=code, restarts=p.restarts, reason=reason,
            time=time.time()).write_first(lr.store, lr.keys.aborted())


def supervise(lr: LocalRun, monitor, interrupted) -> int:
    """Restart crashed looping stages with backoff (bounded), until every one exited cleanly.

    A stage that exits with EXIT_STORE_UNAVAILABLE gave up waiting for the store: the runner
    checks the store itself (waiting up to the same deadline) and fails the run if it is
    still down, rather than spending the stage's restarts on an outage.
    """
    limit = lr.cfg.pipeline.max_restarts
    while True:
        if interrupted():
            monitor.say("interrupted: stopping all stages (state is kept; resume with "
                        f"{resume_hint(lr)})")
            lr.stop_all()
            return EXIT_INTERRUPTED
        running = 0
        for i, p in enumerate(lr.procs):
            code = p.popen.poll()
            if code is None:
                running += 1
                continue
            if code == 0 or p.exit_code == 0:
                p.exit_code = 0
                continue
            running += 1
            if p.restart_at is None:
                if p.name == "learn" and lr.channel is not None:
                    # versions it named and may not have committed: gone before the backoff
                    weights_channel.Channel(lr.channel).clear()
                marker = Aborted.read(lr.store, lr.keys.aborted(), optional=True)
                if marker is not None:  # the stage (or another) stopped the run for good
                    monitor.say(f"run aborted: {marker.describe()}")
                    lr.stop_all()
                    return 1
                release_cache(lr.run_id)  # the model files of the process that ended
                if code == EXIT_STORE_UNAVAILABLE:
                    lr.store.exists(lr.keys.run_json())  # raises StoreUnavailable if still down
                if code == EXIT_CONFIG:  # the same config would fail the same way again
                    monitor.say(f"{p.name} found the run's config invalid{last_error(p.log)}; "
                                f"see {p.log}. Stopping the run: a resumed run keeps its "
                                "config, so start a new one with the setting fixed.")
                    abort(lr, p, code, "the run's config is invalid")
                    lr.stop_all()
                    return 1
                if p.restarts >= limit:
                    monitor.say(f"{p.name} failed {p.restarts + 1} times (exit {code})"
                                f"{last_error(p.log)}; see {p.log}. Stopping the run (resume "
                                f"with {resume_hint(lr)} once the cause is fixed).")
                    abort(lr, p, code)
                    lr.stop_all()
                    return 1
                delay = restart_delay(p.restarts)
                monitor.say(f"{p.name} exited with {code}; restarting in {delay:g} s "
                            f"({p.restarts + 1}/{limit})")
                p.restart_at = time.monotonic() + delay
            elif time.monotonic() >= p.restart_at:
                fresh = lr.start(p.name, p.worker)
                fresh.restarts = p.restarts + 1
                lr.procs[i] = fresh
        lr.sample_rss(lr.procs)
        lr.rss.mark("start")  # once: the looping stages' CPU as the RL phase begins
        if "end" not in lr.rss.window and lr.store.exists(lr.keys.done()):
            lr.rss.mark("end")
        monitor.tick()
        if running == 0:
            return 0
        time.sleep(0.5)
