"""What every stage gets: its config, its store, its run's keys, logging and metrics."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from ..config import RunConfig, load_config, validate
from ..config.loader import apply_overrides, parse_yaml, resolve_mapping
from ..lifetime import running
from ..quiet import quiet_libraries
from ..redact import redact_tracebacks, redacted
from ..store import RunKeys, Store, open_store, write_shard
from ..store.base import RetryPolicy
from ..store.records import Aborted, PolicyPointer
from ..store.schemas import METRICS
from .cores import CoreShare

if TYPE_CHECKING:
    from .policy import BasePolicy

ABORT_CHECK_S = 5.0
"""Longest time between two looks for the abort marker in a looping stage."""


def load_stage_config(value: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A config from a file path, a preset name, or inline YAML text (a pipeline parameter:
    text with a line break, a `{...}` flow mapping or a `key: value` line), read as a config
    file is (a key given twice, invalid YAML or a top level that is not a mapping is a
    ConfigError)."""
    inline = "\n" in value or (not Path(value).exists() and (
        value.lstrip().startswith("{") or _one_line_config(value)))
    if inline:
        data = resolve_mapping(parse_yaml(value, "<inline config>"))
        return validate(apply_overrides(data, overrides), "<inline config>")
    return load_config(value, overrides)


def _one_line_config(value: str) -> bool:
    """Whether one line of text is a config (`extends: scalerl`), not a file's name with
    ': ' in it: a mapping of config sections."""
    if ": " not in value:
        return False
    try:
        data = parse_yaml(value, "<inline config>")
    except ValueError:
        return False
    return all(key == "extends" or key in RunConfig.model_fields for key in data)


def retry_policy(cfg: RunConfig) -> RetryPolicy:
    """The store's retry policy: `store.retry.max_attempts` at least, and as many more as
    it takes to keep retrying until `deadline_s` (each delay is at least half its cap, so
    the doubling ramp plus `2 * deadline / max_delay` attempts span the deadline)."""
    r = cfg.store.retry
    ramp = max(0, math.ceil(math.log2(r.max_delay_s / r.base_delay_s))) + 1
    span = ramp + math.ceil(2 * r.deadline_s / r.max_delay_s) + 1
    return RetryPolicy(max_attempts=max(r.max_attempts, span), base_delay_s=r.base_delay_s,
                       max_delay_s=r.max_delay_s, deadline_s=r.deadline_s)


class RedactingFormatter(logging.Formatter):
    """Log lines, tracebacks included, with credentials in URLs masked (`redact.redacted`):
    a library's error may quote an address with `user:password@` in it."""

    def format(self, record: logging.LogRecord) -> str:
        return redacted(super().format(record))


def setup_logging(stage: str, worker: int) -> logging.Logger:
    quiet_libraries()
    name = stage if worker == 0 else f"{stage}.{worker}"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(f"%(asctime)s {name} %(levelname)s %(message)s",
                                            datefmt="%H:%M:%S"))
    logging.basicConfig(level=os.environ.get("SHARDRL_LOG_LEVEL", "INFO"), handlers=[handler],
                        force=True)
    redact_tracebacks()  # an uncaught exception's traceback too
    return logging.getLogger(f"shardrl.{stage}")


class MetricsSink:
    """Buffers namespaced metric points and writes them as immutable chunks under metrics/."""

    def __init__(self, store: Store, keys: RunKeys, stage: str, worker: int,
                 flush_every_s: float = 5.0) -> None:
        self.store, self.keys, self.stage, self.worker = store, keys, stage, worker
        self.flush_every_s = flush_every_s
        self._rows: list[tuple[str, int, float, float]] = []
        self._last_flush = time.monotonic()
        self._last_key_us: int | None = None
        """The last chunk's name (microseconds); None until the first write looks it up."""
        self.defer: Callable[[Callable[..., None], list], None] | None = None
        """Where a flush's write goes instead of this thread: the learner's commit writer,
        so that a step's figures land after its commit and never for a commit that did not
        (a learner restarted before it redoes that step)."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record `{name: value}` at `step` (the policy version); names get the stage prefix."""
        now = time.time()
        for name, value in values.items():
            full = name if "/" in name else f"{self.stage}/{name}"
            self._rows.append((full, int(step), float(value), now))
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        self._last_flush = time.monotonic()
        if self.defer is not None:
            self.defer(self._write, rows)
            return
        try:
            self._write(rows)
        except BaseException:
            self._rows[:0] = rows  # kept for the next flush
            raise

    def _write(self, rows: list[tuple[str, int, float, float]]) -> None:
        names, steps, values, times = zip(*rows, strict=True)
        table = pa.table({
            "stage": [self.stage] * len(names), "name": list(names), "step": list(steps),
            "value": list(values), "time": list(times),
        })
        # named by the clock, but never below the last name: readers resume after the newest
        # chunk they read, so one named earlier after the clock stepped back would be missed
        now_us = time.time_ns() // 1000
        if self._last_key_us is None:
            self._last_key_us = self._newest_stored(now_us)
        self._last_key_us = max(now_us, self._last_key_us + 1)
        write_shard(self.store, self.keys.metrics_chunk(self.stage, self.worker,
                                                        self._last_key_us), table, METRICS)

    def _newest_stored(self, now_us: int) -> int:
        """The name of this writer's newest chunk named after `now_us`, or 0: a process that
        takes over a worker's place (a restart, on a machine whose clock may be behind the
        last one's) continues after the chunks its predecessor wrote."""
        after = self.keys.metrics_chunk(self.stage, self.worker, now_us)
        prefix = after[:after.rindex("/", 0, after.rindex("/")) + 1]  # .../w<WW>/
        newest = 0
        while page := self.store.list(prefix, start_after=after, limit=1000):
            after = page[-1]
            for key in page:
                name = key.rpartition("/")[2].removesuffix(".parquet")
                if name.isdigit():
                    newest = max(newest, int(name))
            if len(page) < 1000:
                break
        return newest


@dataclass
class StageContext:
    """Everything a stage's `main` needs; built once from the command line."""

    stage: str
    cfg: RunConfig
    run_id: str
    store: Store
    worker: int = 0
    workers: int = 1
    once: bool = False
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("shardrl"))
    metrics: MetricsSink | None = None
    cores: CoreShare = field(default_factory=lambda: CoreShare(None, 1, 1))
    """This stage's share of the machine's cores (wrap heavy work in `cores.busy()`)."""
    _abort: Aborted | None = None
    _abort_checked: float = float("-inf")
    _idle_watches: list = field(default_factory=list)
    """Watches this stage no longer waits on, closed when it ends (see `retire`)."""

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    def done(self) -> bool:
        """True once the learner has written DONE.json, or the run was aborted (`aborted`):
        looping stages stop."""
        return self.aborted() is not None or self.store.exists(self.keys.done())

    def aborted(self) -> Aborted | None:
        """The run's abort marker (another stage failed for good), or None. Looked up at most
        every `ABORT_CHECK_S` seconds (a poll loop calls it often); remembered once seen, and
        logged then."""
        now = time.monotonic()
        if self._abort is None and now - self._abort_checked >= ABORT_CHECK_S:
            self._abort_checked = now
            self._abort = Aborted.read(self.store, self.keys.aborted(), optional=True)
            if self._abort is not None:
                self.log.error("run aborted: %s; stopping", self._abort.describe())
        return self._abort

    def wait_for_run(self) -> None:
        """Block until the snapshot has created the run (`run.json`, its last write). A
        looping stage may start before that: the local runner starts them while the
        snapshot runs, so that their start-up overlaps it. Each looping stage calls this
        itself, once it has done the part of its start-up that needs nothing of the run but
        policy v0 (`preload_policy`)."""
        key = self.keys.run_json()
        if self.store.exists(key):
            return
        self.log.info("waiting for the run's snapshot (%s)", key)
        watch = self.store.watch(self.keys.root, depth=0)
        try:
            while not self.store.exists(key):
                watch.wait(1.0)
        finally:
            self.retire(watch)

    def preload_policy(self) -> BasePolicy:
        """Policy v0, loaded as soon as the snapshot has uploaded it (`policy.BasePolicy`):
        call before `wait_for_run`, then `take()` the model and tokenizer once the run
        exists."""
        from .policy import BasePolicy

        base = BasePolicy(self.store, self.keys, self.cache_dir())
        if not base.ready():
            # said once: a stage started on a run id with no snapshot coming would wait in
            # silence (`shardrl stage` with a mistyped --run-id)
            self.log.info("waiting for the run's snapshot to publish policy v0 (%s in %s)",
                          self.keys.policy_prefix(0), self.store.uri)
            watch = self.store.watch(self.keys.root, depth=2)  # root, policy/, policy/v000000/
            try:
                while not base.ready():
                    watch.wait(1.0)
            finally:
                self.retire(watch)
        base.preload()
        return base

    def latest_version(self) -> int | None:
        """The newest published policy version, or None before the snapshot finished."""
        pointer = PolicyPointer.read(self.store, self.keys.latest_policy(), optional=True)
        return pointer.version if pointer is not None else None

    def wait_for_policy(self, poll_interval_s: float) -> int:
        """The newest published policy version, once there is one (the snapshot publishes
        version 0 before it writes run.json, so after `wait_for_run` this returns at once)."""
        if (version := self.latest_version()) is not None:
            return version
        watch = self.store.watch(self.keys.root + "policy/", depth=0)
        try:
            while (version := self.latest_version()) is None:
                watch.wait(poll_interval_s)
        finally:
            self.retire(watch)
        return version

    def retire(self, watch) -> None:
        """Keep a watch this stage no longer waits on open until the stage ends (`close`).
        Closing an inotify descriptor waits for the kernel's grace period (0.1-14 ms
        measured here, most often over 10), and the watches a stage is done with at start
        would put that wait between the snapshot and the run's first shard and step."""
        self._idle_watches.append(watch)

    def close(self) -> None:
        """Close what the stage kept open for its life (`retire`) and remove its model-file
        cache (`release_cache`)."""
        while self._idle_watches:
            self._idle_watches.pop().close()
        release_cache(self.run_id)

    def as_stage(self, stage: str, worker: int | None = None) -> StageContext:
        """This context doing another stage's work in this process (inline post-processing,
        the snapshot's evaluation of v0): its metrics go under that stage's name, as worker
        `worker` (this one's by default)."""
        worker = self.worker if worker is None else worker
        return replace(self, stage=stage,
                       metrics=MetricsSink(self.store, self.keys, stage, worker))

    def cache_dir(self) -> Path:
        """This process's local folder for the model files it downloads (the policy's v0
        folder, the reference): `cache_root()/RUN/STAGE-WORKER-PID`, removed when the stage
        ends (`release_cache`)."""
        path = cache_root() / self.run_id / f"{self.stage}-{self.worker}-{os.getpid()}"
        path.mkdir(parents=True, exist_ok=True)
        return path


def cache_root() -> Path:
    """Where stages download model files: `SHARDRL_CACHE`, else `~/.cache/shardrl`."""
    return Path(os.environ.get("SHARDRL_CACHE", Path.home() / ".cache" / "shardrl"))


def release_cache(run_id: str) -> None:
    """Remove the model-file caches of `run_id` that no running process uses: this
    process's, and those of processes that have exited (a stage killed before it could remove
    its own); then the run's folder once it is empty.

    A stage loads the files it downloads at its start, into memory (v0 twice when the
    snapshot published it again before run.json, see `policy.BasePolicy`), and every process
    downloads its own copy (a SmolLM2 policy folder is about 0.5 GB per stage), so nothing
    reads them after the stage ends and, kept, they would add up run after run."""
    run_dir = cache_root() / run_id
    try:
        entries = list(run_dir.iterdir())
    except OSError:  # never created, or removed meanwhile
        return
    for entry in entries:
        pid = entry.name.rpartition("-")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not running(int(pid))):
            shutil.rmtree(entry, ignore_errors=True)
    with contextlib.suppress(OSError):  # another stage's cache is still there
        run_dir.rmdir()


def warm_up() -> None:
    """One-time lazy loads that would otherwise land on a stage's first step: pyarrow loads
    its pandas shim (a fifth of a second on a small core) at its first conversion of Python
    values, which the learner's first batch or the generator's first shard would pay."""
    pa.array([0])


def build_context(args) -> StageContext:
    warm_up()
    cfg = load_stage_config(args.config, args.overrides)
    log = setup_logging(args.name, args.worker)
    store = open_store(args.store or cfg.store.uri, retry_policy(cfg))
    ctx = StageContext(stage=args.name, cfg=cfg, run_id=args.run_id, store=store,
                       worker=args.worker, workers=args.workers, once=args.once, log=log)
    ctx.metrics = MetricsSink(store, ctx.keys, args.name, args.worker)
    return ctx
