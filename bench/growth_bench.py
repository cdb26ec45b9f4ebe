"""Growth with run length: the cost of each looping stage's poll late in a long run versus
the same poll in a fresh run, on a folder store and on S3 (a throwaway SeaweedFS server).

One store holds two runs. "late" has the layout a long run leaves: 100,000 shards over
5,000 versions (rollouts, scored and ready), one ledger per learner commit, the policy
versions garbage collection keeps, an evaluation every 10 versions, the metric chunks of a
10,000-step run (one per writer and step, 8 writers) and the cursors of a run whose slowest
rollout worker is 8 versions behind. "fresh" holds only the open window: the last 9 versions,
their ledgers, the newest evaluation, 3 chunks per writer. Objects that the polls only list
are a few bytes; what they read (new ready shards, new metric chunks, state) is real.
Metric chunks come twice, in runs of their own: flat (`metrics/<stage>/wWW-<time>.parquet`,
as `MetricsSink` names them) and bucketed (`RunKeys.metrics_chunk`).

Polls timed, late and fresh side by side, alternating which goes first, after a warm-up
(a sample is the mean of as many calls as take ~30 ms in the fresh run): the learner's
discovery and admission (`Scanner.poll` at its version + reading the 2 new ready shards),
score's and prepare's `Scanner.poll`, rollout's checks before a shard (DONE, LATEST,
`backlog`), evaluate's poll, the runner's tick (progress, newest evaluation, forwarding one
new chunk per writer) and the live doctor's read (`ChunkReader.poll`). The control is a full
listing of `metrics/`, what the forwarder and the doctor did per poll before.
Target: late / fresh <= 1.5 per poll. The folder store is filled with plain file writes and
hard links (no fsync, to save time); S3 with puts from a thread pool, at `--s3-scale` of the
sizes (SeaweedFS takes a few hundred PUTs per second on 2 cores).

    .venv/bin/python -m bench.growth_bench            # both backends, results under "growth"
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa

from bench.results import RESULTS, merge_results
from shardrl.config import RunConfig
from shardrl.doctor.series import ChunkReader, Reducer
from shardrl.orchestrate.forward import Settled
from shardrl.orchestrate.monitor import Monitor
from shardrl.stages.context import StageContext
from shardrl.stages.evaluate import Schedule
from shardrl.stages.rollout import backlog
from shardrl.stages.scan import Scanner, output_names
from shardrl.store import LocalStore, RunKeys, Store, read_or_quarantine
from shardrl.store.keys import metrics_writer
from shardrl.store.records import Progress
from shardrl.store.schemas import METRICS, READY
from shardrl.store.shards import encode_shard

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5
VERSIONS, SHARDS_PER_VERSION, STEPS = 5_000, 20, 10_000
K, WORKERS, EVAL_EVERY, WINDOW_CHUNKS = 8, 4, 10, 3
WRITERS = [("evaluate", 0), ("learn", 0), ("prepare", 0), ("score", 0),
           *(("rollout", w) for w in range(WORKERS))]
T_END = 1_712_100_000_000_000
"""Time (microseconds) of each writer's newest chunk; earlier ones every 10 s before it."""
TINY = b"x"

Objects = Iterator[tuple[str, bytes]]


def ready_table(version: int, worker: int, seq: int, groups: int = 8, g: int = 8) -> pa.Table:
    """A small READY shard: `groups` prompt groups of `g` samples, 16+16 tokens per sample."""
    rows = groups * g
    tokens, logprobs = [list(range(16))] * rows, [[-0.5] * 16] * rows
    return pa.table({
        "prompt_id": [f"p{seq}-{i // g}" for i in range(rows)],
        "group_id": [f"w{worker:02d}-{seq:06d}-{i // g:03d}" for i in range(rows)],
        "sample_idx": pa.array([i % g for i in range(rows)], pa.int32()),
        "policy_version": pa.array([version] * rows, pa.int64()),
        "worker": pa.array([worker] * rows, pa.int32()),
        "prompt_text": ["prompt"] * rows, "prompt_token_ids": tokens,
        "response_token_ids": tokens, "behavior_logprobs": logprobs,
        "finish_reason": ["stop"] * rows, "response_text": ["text"] * rows,
        "answer": ["a"] * rows, "category": ["c"] * rows, "created_at": [1.7e9] * rows,
        "reward_verifier": [1.0] * rows, "reward_model": [None] * rows,
        "reward_rm": [float(i % 2) for i in range(rows)],
        "correct": [i % 2 == 1 for i in range(rows)],
        "reward_error": [None] * rows, "ref_logprobs": logprobs,
        "reward_total": [float(i % 2) for i in range(rows)], "advantage": [0.5] * rows,
        "keep": [True] * rows, "filter_reason": [None] * rows,
    }, schema=READY)


def metrics_chunk(stage: str, step: int) -> bytes:
    """A real chunk of 20 points at `step`."""
    names = [f"{stage}/m{i}" for i in range(20)]
    return encode_shard(pa.table({"stage": [stage] * 20, "name": names, "step": [step] * 20,
                                  "value": [0.5] * 20, "time": [1.7e9] * 20}), METRICS)


def chunk_key(rk: RunKeys, stage: str, worker: int, i: int, chunks: int, bucketed: bool) -> str:
    """Chunk `i` of `chunks` of a writer; the last one is written at T_END."""
    t = T_END - (chunks - 1 - i) * 10_000_000
    return (rk.metrics_chunk(stage, worker, t) if bucketed
            else rk.metrics(stage, f"w{worker:02d}-{t:016d}"))


def chunk_objects(rk: RunKeys, steps: int, evals: int, history: bool, bucketed: bool) -> Objects:
    """Each writer's chunks: tiny history, then WINDOW_CHUNKS real ones (the last is new)."""
    for stage, worker in WRITERS:
        chunks = (evals if stage == "evaluate" else steps) if history else WINDOW_CHUNKS
        for i in range(chunks):
            real = i >= chunks - WINDOW_CHUNKS
            yield (chunk_key(rk, stage, worker, i, chunks, bucketed),
                   metrics_chunk(stage, i) if real else TINY)


def run_objects(rk: RunKeys, versions: int, history: bool) -> Objects:
    """Shards, ledgers, policy, evaluations and the state of a run at version `versions`.

    Every version has SHARDS_PER_VERSION rollout shards; all are scored, prepared and
    consumed except at the newest version, where score has 2 rollouts left, prepare 2 scored
    shards and the learner 2 ready ones (real Parquet: it reads them).
    """
    v_new, low = versions, versions - K
    names = [f"w{s % WORKERS:02d}-{s:06d}.parquet" for s in range(SHARDS_PER_VERSION)]
    ready_new = names[-6:-4]
    for v in range(0 if history else low, v_new + 1):
        newest = v == v_new
        for n, name in enumerate(names):
            yield f"{rk.version_prefix('rollouts', v)}{name}", TINY
            if not newest or name not in names[-2:]:
                yield f"{rk.version_prefix('scored', v)}{name}", TINY
            if not newest or name not in names[-4:]:
                data = (encode_shard(ready_table(v, n % WORKERS, n), READY)
                        if newest and name in ready_new else TINY)
                yield f"{rk.version_prefix('ready', v)}{name}", data
        consumed = names[:-6] if newest else names
        yield (rk.state("learn", f"ledger-{v:06d}.json"), json.dumps({
            "version": v, "shards": [{"key": f"{rk.version_prefix('ready', v)}{n}",
                                      "outcome": "admitted", "rows": 64} for n in consumed]
        }).encode())
        if v % EVAL_EVERY == 0 or newest:
            yield rk.policy_file(v, "model.safetensors"), TINY
            yield rk.policy_file(v, "MANIFEST.json"), TINY
            yield rk.eval_table(v), TINY
            yield rk.eval_summary(v), json.dumps({"pass_at_1": 0.5, "version": v}).encode()
    ledger = {str(v): names if v < v_new else names[:-6] for v in range(low, v_new + 1)}
    state = {
        rk.latest_policy(): {"version": v_new},
        rk.eval_latest(): {"version": v_new},
        rk.state("learn", "progress.json"): {
            "version": v_new, "commits": v_new, "ledger": ledger, "beta": 0.0, "kl": {"beta": 0.0},
            "counts": {"consumed": 64 * SHARDS_PER_VERSION * v_new, "filtered": 0},
            "processed_by_worker": {str(w): 5 * v_new for w in range(WORKERS)},
            "staleness": {str(lag): 1000 for lag in range(K + 1)}},
        **{rk.state(stage, "cursor.json"): {"low": low} for stage in ("score", "prepare", "learn")},
        **{rk.state("rollout", f"w{w:02d}.json"): {"next_seq": 5 * v_new + 2,
                                                 "version": low if w == 0 else v_new}
           for w in range(WORKERS)},
    }
    for key, obj in state.items():
        yield key, json.dumps(obj).encode()


def populate(store: Store, objects: Objects, threads: int = 32) -> int:
    """Write every object: into a folder store's files directly, on S3 by a pool of PUTs."""
    if isinstance(store, LocalStore):
        return fill_folder(store.root, objects)
    count = 0
    with ThreadPoolExecutor(threads) as pool:
        batch: list[tuple[str, bytes]] = []
        for item in objects:
            batch.append(item)
            if len(batch) == 4096:
                list(pool.map(lambda kv: store.put_bytes(*kv), batch))
                count, batch = count + len(batch), []
        list(pool.map(lambda kv: store.put_bytes(*kv), batch))
    return count + len(batch)


LINKS_PER_FILE = 50_000
"""Hard links per tiny source file (ext4 allows 65,000 per inode)."""


def fill_folder(root: Path, objects: Objects) -> int:
    """Write `objects` as the folder store lays them out, without fsync; each tiny one is a
    hard link to a shared file (ten times faster to make, and a listing sees the same names).
    The shared files are named `.tiny-<uuid>` at the root: listings skip dot-names."""
    made: set[Path] = set()
    count, links, source = 0, LINKS_PER_FILE, root
    for key, data in objects:
        path = root / key
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        if data is TINY:
            if links == LINKS_PER_FILE:
                source, links = root / f".tiny-{uuid.uuid4().hex}", 0
                source.write_bytes(TINY)
            os.link(source, path)
            links += 1
        else:
            path.write_bytes(data)
        count += 1
    return count


def polls(store: Store, run: str, versions: int, cfg: RunConfig) -> dict[str, Callable[[], object]]:
    """The timed polls of run `run` (metrics in run `run`-b are bucketed)."""
    rk, rkb = RunKeys(run), RunKeys(f"{run}-b")
    ledger = json.loads(store.get_bytes(rk.state("learn", "progress.json")))["ledger"]
    learn = Scanner(store, rk, cfg, "learn", lambda v: set(ledger.get(str(v), ())))
    score = Scanner(store, rk, cfg, "score", output_names(store, rk, "scored"))
    prepare = Scanner(store, rk, cfg, "prepare", output_names(store, rk, "ready"))
    ctx = StageContext(stage="rollout", cfg=cfg, run_id=run, store=store)
    schedule = Schedule(store, rk, EVAL_EVERY, 2 * versions)
    while schedule.due(versions) is not None:  # the fresh run has no record of old evaluations
        schedule.advance()

    def learner() -> None:
        for key in learn.poll(versions):
            assert read_or_quarantine(store, key, READY, "learn") is not None

    def evaluate() -> None:
        ctx.done()
        assert schedule.due(ctx.latest_version()) is None  # everything published is evaluated

    out: dict[str, Callable[[], object]] = {
        "learn_discovery_admission": learner,
        "score_poll": lambda: score.poll(versions),
        "prepare_poll": lambda: prepare.poll(versions),
        "rollout_checks": lambda: (ctx.done(), ctx.latest_version(),
                                   backlog(Progress.read(store, rk.progress()), 1, 5 * versions + 2, None)),
        "evaluate_poll": evaluate,
    }
    for suffix, keys in (("flat", rk), ("bucketed", rkb)):
        out[f"forwarder_tick_{suffix}"] = forwarder(store, keys, cfg, versions)
        out[f"doctor_read_{suffix}"] = doctor_read(store, keys)
    out["control_full_metrics_listing"] = lambda: store.list(rk.root + "metrics/")
    return out


def window_marks(store: Store, rk: RunKeys) -> dict[str, str]:
    """Per writer, its second newest chunk: one new chunk per writer is left to take."""
    marks: dict[str, list[str]] = {}
    for key in store.list(rk.root + "metrics/"):  # setup only, not timed
        marks.setdefault(metrics_writer(key), []).append(key)
    return {w: keys[-2] for w, keys in marks.items()}


def forwarder(store: Store, rk: RunKeys, cfg: RunConfig, versions: int) -> Callable[[], object]:
    """The runner's tick, replayed from the same marks each time."""
    lr = SimpleNamespace(cfg=cfg, store=store, keys=rk, run_id=rk.run_id)
    m = Monitor(lr, progress_bar=False)
    m.client, m.mlflow = SimpleNamespace(log_batch=lambda run_id, metrics: None), "bench"
    marks = window_marks(store, rk)

    def tick() -> None:
        f = m.forwarder  # as it was before the window: nothing read or held since
        f.tail.marks, f.read, f.before, f.seen = dict(marks), {}, {}, set()
        f.open.clear()
        f.settled = Settled(f.settled.writers)
        m.last_tick = 0.0
        with contextlib.redirect_stdout(io.StringIO()):
            m.tick()
        assert m.last_eval[0] == versions and len(f.tail.marks) == len(WRITERS)

    return tick


def doctor_read(store: Store, rk: RunKeys) -> Callable[[], object]:
    reader = ChunkReader(store, rk)
    marks = window_marks(store, rk)

    def read() -> None:
        reader.tail.marks, reader.reducer = dict(marks), Reducer()
        assert reader.poll() == len(WRITERS)

    return read


SAMPLE_S = 0.03
"""A sample runs a poll as many times as take about this long in the fresh run (at least
once) and counts the mean, so a neighbour's burst of load weighs less on a 1 ms poll."""


def measure(late: dict, fresh: dict, repeats: int) -> dict[str, dict]:
    """Median ms per poll late and fresh, their ratio, and min/max of the paired ratios."""
    def timed(fn: Callable[[], object], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    times: dict[str, dict[str, list[float]]] = {p: {"late": [], "fresh": []} for p in late}
    calls = {name: max(1, round(SAMPLE_S / timed(fresh[name], 1))) for name in late}  # warm-up
    for r in range(repeats):
        for name in late:
            for label, fns in [("late", late), ("fresh", fresh)][:: 1 if r % 2 else -1]:
                times[name][label].append(timed(fns[name], calls[name]))
    out = {}
    for name, t in times.items():
        pairs = [a / b for a, b in zip(t["late"], t["fresh"], strict=True)]
        lm, fm = statistics.median(t["late"]), statistics.median(t["fresh"])
        out[name] = {"late_ms": round(1e3 * lm, 3), "fresh_ms": round(1e3 * fm, 3),
                     "calls_per_sample": calls[name], "ratio": round(lm / fm, 3),
                     "ratio_min": round(min(pairs), 3), "ratio_max": round(max(pairs), 3)}
    return out


def backend(store: Store, scale: float, repeats: int) -> dict:
    """Fill `store` with both runs at `scale` of the full sizes and time every poll."""
    versions, steps = max(K + 2, round(VERSIONS * scale)), max(20, round(STEPS * scale))
    evals = versions // EVAL_EVERY + 1
    started = time.perf_counter()
    count = 0
    for run, history in (("late", True), ("fresh", False)):
        count += populate(store, run_objects(RunKeys(run), versions, history))
        count += populate(store, chunk_objects(RunKeys(run), steps, evals, history, False))
        rkb = RunKeys(f"{run}-b")
        count += populate(store, chunk_objects(rkb, steps, evals, history, True))
        for key in (RunKeys(run).progress(), RunKeys(run).eval_latest(),
                    RunKeys(run).eval_summary(versions)):
            populate(store, [(rkb.root + key.split("/", 2)[2], store.get_bytes(key))])
    fill_s = time.perf_counter() - started
    print(f"  {count} objects written in {fill_s:.0f} s ({count / fill_s:.0f}/s)", file=sys.stderr)
    cfg = RunConfig.model_validate({"tracking": {"enabled": False}, "rollout": {
        "workers": WORKERS, "postprocess": "stages"}})
    result = measure(polls(store, "late", versions, cfg), polls(store, "fresh", versions, cfg),
                     repeats)
    for name, r in result.items():
        print(f"  {name:28} late {r['late_ms']:9.2f} ms  fresh {r['fresh_ms']:8.2f} ms  "
              f"ratio {r['ratio']:7.2f} [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]",
              file=sys.stderr)
    return {"scale": scale, "versions": versions, "shards": versions * SHARDS_PER_VERSION,
            "chunks_per_writer": steps, "objects": count, "fill_s": round(fill_s, 1),
            "polls": result,
            "within_target": {n: r["ratio"] <= TARGET for n, r in result.items()
                              if not n.startswith("control")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--scale", type=float, default=1.0, help="of the sizes, folder store")
    parser.add_argument("--s3-scale", type=float, default=0.05, help="of the sizes, on S3")
    parser.add_argument("--no-s3", action="store_true", help="measure the folder store only")
    args = parser.parse_args()
    started = time.perf_counter()
    backends = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDRL_BENCH_TMP")) as folder:
        print(f"local (scale {args.scale})", file=sys.stderr)
        backends["local"] = backend(LocalStore(folder), args.scale, args.repeats)
    if not args.no_s3:
        print(f"s3 on SeaweedFS (scale {args.s3_scale})", file=sys.stderr)
        from bench.store_bench import s3_store  # a throwaway SeaweedFS server

        with s3_store() as store:
            backends["s3"] = backend(store, args.s3_scale, args.repeats)
    merge_results("growth", {
        "target_ratio": TARGET, "repeats": args.repeats, "writers": len(WRITERS),
        "window_versions": K + 1, "cpus": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "seconds": round(time.perf_counter() - started, 1), "backends": backends,
    })
    print(f"merged under 'growth' into {RESULTS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
