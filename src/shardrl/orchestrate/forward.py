"""Metric forwarding to MLflow: one point per metric and step, sent once the step is settled.

The stages log a point per rollout shard (about 30 names, several shards a step) besides the
learner's per-step points: about 150 points a step at the demo's size. MLflow's SQL store
spends about 0.2 ms of CPU on each, in the runner, on the cores the stages train on. The
doctor reduces a step's points to one value anyway (`Reducer`: the mean, the largest for
maxima and counters), so the forwarder sends that value instead of the points: 2-3x fewer
rows, and the doctor reads the same series from MLflow as from the store.

A step is reduced once no more points can come for it. Each metrics writer (`<stage>/wWW`,
one process) logs its steps in increasing order and its chunks are read in order, so a step
of a stage is settled when every writer of the stage has logged a later step (`Settled`).
Score and prepare, run as stages of their own, log each shard at the version that generated
it, in the order the shards reach them: a worker's shard of version v can come after another
worker's of v + k (k the staleness bound), so their steps settle k steps later.
Until then its points wait in memory; the last step of each stage waits for the end of the
run (`forward(final=True)`). One-shot stages (the snapshot, promote) are sent as read.

Nothing is lost across a restart of the runner: `state/runner/forwarded.json` keeps per
writer the last chunk whose points were all sent (`marks`) and the last chunk read (`read`),
and per stage the step below which every point was sent (`released`). A new forwarder
re-reads the chunks after the marks and drops, from those read before, the points below that
step. A point that arrives for a step already sent (a writer that starts late, or one whose
steps went back) is sent as a point of its own, as every point was before.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable

import pyarrow as pa

from ..doctor.series import ChunkTail, reduced
from ..graph import GENERATOR, STAGES, stage
from ..store import NotFound, RunKeys, Store, read_columns
from ..store.keys import metrics_writer

log = logging.getLogger("shardrl.forward")
EMPTY = pa.table({"name": pa.array([], pa.string()), "step": pa.array([], pa.int64()),
                  "value": pa.array([], pa.float64()), "time": pa.array([], pa.float64())})
"""The points of a chunk that cannot be read."""

TimedPoint = tuple[str, int, float, float]
"""(name, step, value, time): a metric point as MLflow takes it (time in epoch seconds)."""


BY_SHARD_VERSION = ("score", "prepare")
"""Stages that, run on their own, log each shard at its generating version, as shards come."""


SETTLE_LAG_MAX = 32
"""The most steps a stage's points wait for late shards: a larger k would hold them all in
the runner's memory, unsent, for the whole run (a shard later still goes as a point of its
own)."""


def settle_lags(cfg) -> dict[str, int]:
    """Steps a stage's newest step must pass a step by before it settles: k for score and
    prepare run as stages (inline, each rollout worker logs its own shards in order), at most
    `SETTLE_LAG_MAX`."""
    return {s.name: min(cfg.learner.max_staleness, SETTLE_LAG_MAX) for s in STAGES
            if s.name in BY_SHARD_VERSION and s.enabled(cfg)}


def metric_writers(cfg) -> dict[str, int]:
    """Processes that log each looping stage's metrics: its replicas, or the rollout
    workers for a stage they run inline."""
    workers = stage(GENERATOR).replicas(cfg)
    return {s.name: s.replicas(cfg) if s.enabled(cfg) else workers
            for s in STAGES if s.loops}


class Settled:
    """Points reduced per (name, step) as `Reducer` does, released per stage once settled.

    `writers` names the looping stages and how many processes log each: a stage's steps are
    held until that many of its writers have logged. A stage it does not name (a one-shot
    stage) is released as read."""

    def __init__(self, writers: dict[str, int], released: dict[str, int] | None = None,
                 lags: dict[str, int] | None = None) -> None:
        self.writers = writers
        self.lags = dict(lags or {})
        """stage -> steps its writers' newest step must be past a step for it to settle."""
        self.released: dict[str, int] = dict(released or {})
        """stage -> the step below which every point read so far was released."""
        self.newest: dict[str, int] = {}
        """writer -> the newest step it logged."""
        self.cells: dict[str, dict[tuple[str, int], list]] = defaultdict(dict)
        """stage -> (name, step) -> [count, sum, max, all finite, newest time]"""

    def saw(self, writer: str, step: int) -> None:
        """`writer` logged `step` (its steps never decrease)."""
        self.newest[writer] = max(int(step), self.newest.get(writer, int(step)))

    def add(self, writer: str, name: str, step: int, value: float, at: float) -> None:
        """A point of `writer`'s (which `saw` must be told of its newest step)."""
        step, value = int(step), float(value)
        cells = self.cells[writer.split("/", 1)[0]]
        cell = cells.get((name, step))
        if cell is None:
            cells[(name, step)] = [1, value, value, math.isfinite(value), at]
        else:
            cell[0] += 1
            cell[1] += value
            cell[2] = max(cell[2], value)
            cell[3] = cell[3] and math.isfinite(value)
            cell[4] = max(cell[4], at)

    def bound(self, stage_name: str) -> float:
        """The step below which `stage_name`'s points are settled (-inf: none yet)."""
        expected = self.writers.get(stage_name)
        if expected is None:
            return math.inf
        mine = [s for w, s in self.newest.items() if w.split("/", 1)[0] == stage_name]
        if len(mine) < expected:
            return -math.inf
        return min(mine) - self.lags.get(stage_name, 0)

    def release(self, final: bool = False) -> list[TimedPoint]:
        """The settled points (all of them when `final`), one per (name, step), in step order;
        `released` moves past them."""
        out: list[TimedPoint] = []
        for stage_name, cells in self.cells.items():
            bound = math.inf if final else self.bound(stage_name)
            ripe = sorted((k for k in cells if k[1] < bound), key=lambda k: (k[1], k[0]))
            for name, step in ripe:
                cell = cells.pop((name, step))
                out.append((name, step, reduced(name, cell), cell[4]))
            top = max((step + 1 for _, step in ripe), default=None) if bound == math.inf \
                else bound
            if top is not None and top > self.released.get(stage_name, -math.inf):
                self.released[stage_name] = int(top)
        return out


class SendFailed(Exception):
    """Sending points to MLflow failed (its `__cause__` says how); they go again with the
    next `forward` unless `Forwarder.unsent` is emptied."""


class Forwarder:
    """Sends a run's metric chunks to `send` (MLflow's `log_batch` in batches), reduced per
    step, keeping its place in `state/runner/forwarded.json`."""

    def __init__(self, store: Store, keys: RunKeys, writers: dict[str, int],
                 send: Callable[[list[TimedPoint]], None],
                 lags: dict[str, int] | None = None) -> None:
        self.store, self.send = store, send
        self.key = keys.state("runner", "forwarded.json")
        saved = store.get_json(self.key) if store.exists(self.key) else {}
        if "marks" not in saved:  # the format before reduction: {writer: last chunk sent}
            saved = {"marks": saved, "read": {}, "released": {}}
        self.tail = ChunkTail(store, keys, saved["marks"])
        self.read: dict[str, str] = dict(saved["read"])
        """writer -> the last chunk read, by this forwarder or the one before it."""
        self.before = dict(self.read)
        """writer -> the last chunk the forwarder before this one read: of the chunks up to
        it, the points below the stage's `released` step were sent."""
        self.settled = Settled(writers, saved["released"], lags)
        self.open: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
        """writer -> (chunk, its newest step) read but not taken, in order."""
        self.seen: set[str] = set()
        """The open chunks' keys (the tail lists them again until they are taken)."""
        self.unsent: list[TimedPoint] = []
        """Released points whose sending failed: sent first by the next `forward`."""

    def forward(self, final: bool = False) -> int:
        """Read the new chunks, send what is settled (everything when `final`); the number of
        points sent. A send that fails raises, and its points go again with the next call
        (the saved place stays where it was: a new forwarder sends them too)."""
        for key in self.tail.poll():
            if key not in self.seen:
                self._read(key)
        points, self.unsent = self.unsent + self.settled.release(final), []
        if points:
            try:
                self.send(points)
            except Exception as exc:
                self.unsent = points
                raise SendFailed(f"{type(exc).__name__}: {exc}") from exc
        if self._take() or points:
            self.store.put_json(self.key, {"marks": self.tail.marks, "read": self.read,
                                           "released": self.settled.released})
        return len(points)

    def _read(self, key: str) -> None:
        writer = metrics_writer(key)
        # points the forwarder before this one read and sent: below its released step
        floor = (self.settled.released.get(writer.split("/", 1)[0], -math.inf)
                 if key <= self.before.get(writer, "") else -math.inf)
        try:
            table = read_columns(self.store.get_bytes(key), ["name", "step", "value", "time"])
        except NotFound:  # deleted meanwhile: nothing to send
            table = EMPTY
        except (pa.ArrowException, ValueError) as e:  # truncated or foreign: as the doctor does
            log.warning("metrics chunk %s does not decode (%s); forwarding goes on without "
                        "it", key, e)
            table = EMPTY
        newest = None
        for name, step, value, at in zip(*(table.column(c).to_pylist()
                                           for c in ("name", "step", "value", "time")),
                                         strict=True):
            newest = step if newest is None else max(newest, step)
            if step >= floor:
                self.settled.add(writer, name, step, value, at)
        if newest is not None:
            self.settled.saw(writer, newest)
        self.open[writer].append((key, newest))
        self.seen.add(key)
        self.read[writer] = max(key, self.read.get(writer, key))

    def _take(self) -> bool:
        """Move the marks past the chunks whose points were all sent; whether any moved."""
        moved = False
        for writer, chunks in self.open.items():
            released = self.settled.released.get(writer.split("/", 1)[0], -math.inf)
            while chunks and (chunks[0][1] is None or chunks[0][1] < released):
                key = chunks.pop(0)[0]
                self.tail.take([key])
                self.seen.discard(key)
                moved = True
        return moved
