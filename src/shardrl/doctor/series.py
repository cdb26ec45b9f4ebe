"""Metric series of a run, from its store (chunks under `metrics/<stage>/`) or from MLflow.

A run's metrics are points `(name, step, value)`; names are namespaced `stage/name` and the
step is the policy version. Several points can share a step (one per rollout shard), so a
`Series` holds one value per step: the mean of its points, or the largest for maxima and
running counters. Non-finite values are kept: the collapse rule looks for them.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import yaml

from ..config import RunConfig
from ..store import NotFound, RunKeys, Store, StoreError, open_store, read_columns
from ..store.keys import metrics_writer
from ..store.records import recorded_config

log = logging.getLogger("shardrl.doctor")

Point = tuple[str, int, float]
"""(name, step, value)"""

# per-step reduction by the maximum: maxima, and counters that only grow
_MAX_SUFFIXES = ("_max", "stale_dropped", "skipped_steps", "retired_prompts")


@dataclass(frozen=True)
class Series:
    """One metric: `steps` (N,) strictly increasing, `values` (N,) float64."""

    name: str
    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def finite(self) -> Series:
        """The points whose value is finite."""
        ok = np.isfinite(self.values)
        return Series(self.name, self.steps[ok], self.values[ok])


def reduced(name: str, cell: list) -> float:
    """A step's value from its cell `[count, sum, max, all finite, ...]`: the mean of its
    points, or the largest for maxima and counters when all of them are finite."""
    return cell[2] if name.endswith(_MAX_SUFFIXES) and cell[3] else cell[1] / cell[0]


class Reducer:
    """Points reduced per (name, step) as they arrive, in memory that grows with the steps,
    not the points: their count, sum and maximum, and whether all were finite.

    `series` is asked for again and again while points keep arriving (the live doctor, every
    few steps of a run): it keeps each name's last series and redoes only the steps that
    got points since, so a call costs the new points, not the whole run."""

    def __init__(self) -> None:
        self.cells: dict[str, dict[int, list]] = defaultdict(dict)
        """name -> step -> [count, sum, max, all finite]"""
        self._built: dict[str, Series] = {}
        """name -> its series as last returned"""
        self._dirty: dict[str, set[int]] = defaultdict(set)
        """name -> steps with points added since its series was last built"""

    def add(self, name: str, step: int, value: float) -> None:
        value, step = float(value), int(step)
        cell = self.cells[name].get(step)
        if cell is None:
            self.cells[name][step] = [1, value, value, math.isfinite(value)]
        else:
            cell[0] += 1
            cell[1] += value
            cell[2] = max(cell[2], value)
            cell[3] = cell[3] and math.isfinite(value)
        self._dirty[name].add(step)

    def series(self, name: str) -> Series:
        """One value per step: mean of that step's points (max for maxima and counters, when
        all of the step's points are finite)."""
        cells, built = self.cells[name], self._built.get(name)
        dirty = self._dirty.pop(name, set())
        if built is not None and not dirty:
            return built
        if built is None or 2 * len(dirty) > len(built):
            out = self._build(name)
        else:  # patch the steps that changed into the last series, insert the new ones
            steps = np.asarray(sorted(dirty), dtype=np.int64)  # (D,)
            values = np.asarray([reduced(name, cells[int(s)]) for s in steps], dtype=np.float64)
            at = np.searchsorted(built.steps, steps)  # (D,)
            known = built.steps[np.minimum(at, len(built) - 1)] == steps
            patched = built.values.copy()  # a returned series stays as it was
            patched[at[known]] = values[known]
            new = ~known
            out = Series(name, np.insert(built.steps, at[new], steps[new]),
                         np.insert(patched, at[new], values[new]))
        self._built[name] = out
        return out

    def _build(self, name: str) -> Series:
        cells = self.cells[name]
        ordered = sorted(cells)
        return Series(name, np.asarray(ordered, dtype=np.int64),
                      np.asarray([reduced(name, cells[s]) for s in ordered], dtype=np.float64))

    def metrics(self) -> Metrics:
        return Metrics({name: self.series(name) for name in self.cells})


def reduce_points(name: str, steps: Iterable[int], values: Iterable[float]) -> Series:
    """One value per step: mean of that step's points (max for maxima and counters)."""
    reducer = Reducer()
    for s, v in zip(steps, values, strict=True):
        reducer.add(name, s, v)
    return reducer.series(name)


class Metrics:
    """All series of a run by name; `m.get("learn/kl_sum")` is None when never logged."""

    def __init__(self, series: dict[str, Series]) -> None:
        self.series = series

    @classmethod
    def from_points(cls, points: Iterable[Point]) -> Metrics:
        reducer = Reducer()
        for name, step, value in points:
            reducer.add(name, step, value)
        return reducer.metrics()

    def get(self, name: str) -> Series | None:
        return self.series.get(name)

    def names(self) -> list[str]:
        return sorted(self.series)

    def __contains__(self, name: str) -> bool:
        return name in self.series

    def to_points(self) -> list[Point]:
        """Every (name, step, value) after the per-step reduction (for fixtures and JSON)."""
        return [(s.name, int(t), float(v)) for s in self.series.values()
                for t, v in zip(s.steps, s.values, strict=True)]


def read_chunk(store: Store, key: str) -> list[Point]:
    """The points of one metrics chunk (a METRICS Parquet table)."""
    table = read_columns(store.get_bytes(key), ["name", "step", "value"])
    return list(zip(table.column("name").to_pylist(), table.column("step").to_pylist(),
                    table.column("value").to_pylist(), strict=True))


class ChunkTail:
    """The metric chunks of a run not taken yet, found without listing the ones taken.

    Each writer (`<stage>/w<WW>`, one process of a stage) names its chunks in increasing
    order, flat or bucketed (see `RunKeys.metrics_chunk`), and its keys are contiguous in key
    order, so `marks` (writer -> last chunk taken) splits a writer's chunks into taken and
    new. A poll walks `metrics/` with a cursor: at a writer's first key it jumps to the
    writer's mark and collects what follows, until the next writer's first key. That is one
    short listing per writer, however many chunks the run has left behind.
    """

    FIRST_PAGE, LAST_PAGE = 16, 1000
    """Keys asked per listing: few after a jump (about one new chunk per writer per poll),
    growing fourfold per full page while a writer's backlog (or a new writer's history) lasts."""

    def __init__(self, store: Store, keys: RunKeys, marks: dict[str, str] | None = None) -> None:
        self.store, self.prefix = store, keys.root + "metrics/"
        self.marks: dict[str, str] = dict(marks or {})

    def poll(self) -> list[str]:
        """The chunk keys after the marks, in key order (`take` them once used)."""
        new: list[str] = []
        after: str | None = None
        limit = self.FIRST_PAGE
        while page := self.store.list(self.prefix, start_after=after, limit=limit):
            for key in page:
                mark = self.marks.get(metrics_writer(key))
                if mark is not None and key <= mark:
                    after, limit = mark, self.FIRST_PAGE  # taken before: skip to the mark
                    break
                if key.endswith(".parquet"):
                    new.append(key)
                after = key
            else:
                if len(page) < limit:
                    break
                limit = min(4 * limit, self.LAST_PAGE)
        return new

    def take(self, chunk_keys: Iterable[str]) -> None:
        """Move the marks past `chunk_keys`: later polls no longer return them."""
        for key in chunk_keys:
            writer = metrics_writer(key)
            self.marks[writer] = max(key, self.marks.get(writer, key))


class ChunkReader:
    """Reads a run's metric chunks incrementally: each chunk once, reduced as it comes."""

    def __init__(self, store: Store, keys: RunKeys) -> None:
        self.store = store
        self.tail = ChunkTail(store, keys)
        self.reducer = Reducer()

    def poll(self) -> int:
        """Read the chunks written since the last poll; returns how many were new. A chunk
        deleted meanwhile, or one that does not decode (a truncated or foreign file), is
        passed over, the latter with a warning: the diagnosis goes on without its points. A
        store error raises, and a later poll reads the chunk again."""
        new = self.tail.poll()
        for key in new:
            try:
                points = read_chunk(self.store, key)
            except NotFound:
                points = []
            except (pa.ArrowException, ValueError) as e:
                log.warning("metrics chunk %s does not decode (%s); the diagnosis goes on "
                            "without it", key, e)
                points = []
            for name, step, value in points:
                self.reducer.add(name, step, value)
            self.tail.take([key])
        return len(new)

    def metrics(self) -> Metrics:
        return self.reducer.metrics()


def load_store_metrics(store: Store, keys: RunKeys) -> Metrics:
    """Every metric series of the run in `store`."""
    reader = ChunkReader(store, keys)
    reader.poll()
    return reader.metrics()


def load_mlflow_metrics(client, run_id: str) -> Metrics:
    """Every metric series of MLflow run `run_id` (`client`: an `MlflowClient`)."""
    points: list[Point] = []
    for name in client.get_run(run_id).data.metrics:
        points += [(name, m.step, m.value) for m in client.get_metric_history(run_id, name)]
    return Metrics.from_points(points)


@dataclass
class RunHandle:
    """A run found in a store: where it lives and its validated config."""

    store: Store
    keys: RunKeys
    cfg: RunConfig


def store_or_default(store_uri: str | None) -> str:
    """The store a command that reads a run looks in: `store_uri`, else the config's default
    store."""
    return store_uri or RunConfig().store.uri


def no_run(command: str, run_id: str, store_uri: str | None) -> str:
    """The one line a command that reads a run says when the store holds no such run."""
    return (f"shardrl {command}: no run {run_id!r} in the store "
            f"{store_or_default(store_uri)!r} (--store names another)")


def open_run(run_id: str, store_uri: str | None) -> RunHandle | None:
    """The run `run_id` in `store_uri` (default: the config's default store), or None when the
    store holds no `run.json` for it."""
    try:
        keys = RunKeys(run_id)
    except ValueError:
        return None
    try:
        store = open_store(store_or_default(store_uri))
        if not store.exists(keys.run_json()):
            return None
        return RunHandle(store, keys, tolerant_config(recorded_config(store, keys.run_json())))
    except StoreError as exc:  # every command that reads a run: one line, not a trace (a bad
        # URI, missing credentials or bucket, a store down past the retry deadline)
        raise SystemExit(f"shardrl: {exc}") from None


def tolerant_config(data: dict) -> RunConfig:
    """The run's config. One the current schema rejects (a run made by an older version)
    keeps every section that still validates, so its tracking and doctor settings hold."""
    try:
        return RunConfig.model_validate(data)
    except ValueError as exc:
        log.warning("run config does not validate (%s); its invalid sections fall back to "
                    "defaults", " ".join(str(exc).split()[:24]))
    kept: dict = {}
    for key, value in data.items():
        try:
            RunConfig.model_validate({**kept, key: value})
        except ValueError:
            continue
        kept[key] = value
    return RunConfig.model_validate(kept)


def mlflow_config(client, run_id: str) -> RunConfig:
    """The run config recorded as MLflow params (flattened `section.field` strings); when they
    do not validate, defaults with the params' `doctor.*` thresholds."""
    params = client.get_run(run_id).data.params
    nested: dict = {}
    for key, text in params.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _param_value(text)
    return tolerant_config(nested)


def _param_value(text: str):
    """A param logged as text or JSON (`str(value)` by older runs) back to a value: None,
    numbers, booleans, lists, text."""
    if text == "None":
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
