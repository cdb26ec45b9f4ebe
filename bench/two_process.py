"""The loop comparison's headroom: an asynchronous trainer in two processes, without the store.

The synchronous loop (`bench.sync_baseline`) split in two: a generator process runs its
`SyncTrainer.batch` (generate, verify, prepare: one learner batch of kept groups) and a
learner process runs its `SyncTrainer.update`, one process per core (pinned when the machine
has two or more). Nothing else: a batch goes to the learner as Arrow IPC bytes over a pipe,
the new weights go back through shared memory, and the generator copies them into its model
before each batch. The generator starts a batch once the learner has taken the one before, so
it is one batch ahead at most and every batch is one version old when it is trained on (the
learner's version minus the batch's policy version is 1, 0 for the first).

It is what ShardRL's two-core async pipeline would do with hand-offs that cost nothing: no
shard files, commits, published versions, metrics or processes beyond these two. It is not a
bound (a faster generator, a different lead or another placement could do better) and not a
baseline (a user cannot run it: it has no crash safety, no resume and no store); it says how
much of the loop comparison's shortfall is ShardRL's own overhead, with the same math, model
and staleness as ShardRL's default (about one version).

The clock starts once both processes have imported the libraries and loaded the snapshot
(`sync_baseline.before_clock`, `load_snapshot`). Every `budget / eval_points` seconds the
learner copies its weights with its clock paused; the copies are evaluated after the budget
(`bench.demo_control.heldout_pass`), as `sync_baseline --eval-after` does.

    .venv/bin/python -m bench.two_process --snapshot DIR --budget 20 --out two.json
    .venv/bin/python -m bench.two_process --compare 0-4   # seeds 0-4 against ShardRL and the loop
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

LEAD = 1
"""Batches the generator may have made that the learner has not taken yet."""


def checksum(model) -> float:
    """A cheap fingerprint of the model's weights: which version the generator sampled from."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def to_bytes(table) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_bytes(data: bytes):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def cores() -> tuple[int | None, int | None]:
    """(generator core, learner core): the first two this process may run on, or no pinning."""
    mine = sorted(os.sched_getaffinity(0))
    return (mine[0], mine[1]) if len(mine) >= 2 else (None, None)


def generator(config: str, overrides: list[str], snapshot: str, shared: dict, version,
              lock, conn, ready, lead, stop, core: int | None) -> None:
    """The generator process: batches from the newest shared weights, sent to the learner."""
    pin(core)
    from bench.sync_baseline import PausableClock, SyncTrainer, before_clock, load_snapshot
    from shardrl.config import load_config

    cfg = load_config(config, overrides)
    before_clock(cfg)
    trainer = SyncTrainer(cfg, Path(snapshot), 1, load_snapshot(Path(snapshot)))
    params = dict(trainer.model.state_dict())  # the model's tensors, written in place
    ready.set()
    clock, events, have = PausableClock(conn.recv()), [], 0
    while True:
        lead.acquire()  # the learner has taken all but LEAD - 1 of the batches made so far
        if stop.is_set():
            return
        with lock:
            if version.value != have:
                for name, tensor in shared.items():
                    params[name].copy_(tensor)
                have = version.value
        trainer.version = trainer.engine.version = have
        fingerprint = checksum(trainer.model)
        table = trainer.batch(clock, events)
        conn.send((fingerprint, trainer.counts["generated"]))
        conn.send_bytes(to_bytes(table))


def run_two_process(config: str, overrides: list[str], snapshot: Path, budget: float,
                    eval_points: int) -> dict:
    """Train from `snapshot` for `budget` seconds of clock; the pass@1 curve (evaluated
    after the budget), the version times and what the batches were sampled from."""
    import torch.multiprocessing as mp

    from bench.demo_control import heldout_pass
    from bench.sync_baseline import (
        PausableClock,
        SyncTrainer,
        before_clock,
        load_snapshot,
        weight_copy,
    )
    from shardrl.config import load_config

    gen_core, learn_core = cores()
    pin(learn_core)
    cfg = load_config(config, overrides)
    before_clock(cfg)
    trainer = SyncTrainer(cfg, snapshot, 1, load_snapshot(snapshot))
    shared = {k: v.detach().clone().share_memory_() for k, v in trainer.model.state_dict().items()}
    ctx = mp.get_context("spawn")
    version, lock, lead = ctx.Value("i", 0, lock=False), ctx.Lock(), ctx.Semaphore(LEAD)
    ready, stop = ctx.Event(), ctx.Event()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=generator, daemon=True,
                       args=(config, overrides, str(snapshot), shared, version, lock, theirs,
                             ready, lead, stop, gen_core))
    proc.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the generator process did not start")
        clock = PausableClock(time.time())
        mine.send(clock.start)
        fingerprints = {0: checksum(trainer.model)}
        interval = budget / max(eval_points, 1)
        copies = [(0.0, 0, clock.paused(weight_copy, trainer.model))]
        next_eval, step_times, lags, mismatched, generated = interval, [], [], 0, 0
        while clock.now() < budget:
            fingerprint, generated = mine.recv()
            table = from_bytes(mine.recv_bytes())
            lead.release()
            sampled_from = table.column("policy_version")[0].as_py()
            mismatched += fingerprint != fingerprints[sampled_from]
            lags.append(trainer.version - sampled_from)
            if trainer.update(table):
                with lock:
                    for name, tensor in trainer.model.state_dict().items():
                        shared[name].copy_(tensor)
                    version.value = trainer.version
                fingerprints[trainer.version] = checksum(trainer.model)
                step_times.append(clock.now())
            at = clock.now()
            if at >= next_eval or at >= budget:
                copies.append((at, trainer.version, clock.paused(weight_copy, trainer.model)))
                while next_eval <= at:
                    next_eval += interval
    finally:  # let the generator finish its batch and return, then make sure it is gone
        stop.set()
        lead.release()
        deadline = time.monotonic() + 30
        while proc.is_alive() and time.monotonic() < deadline:
            if mine.poll(0.05):
                mine.recv_bytes()  # a batch it is still sending
        if proc.is_alive():
            proc.kill()
        proc.join()
    curve = []
    for at, _, state in copies:  # the clock has stopped
        trainer.model.load_state_dict(state)
        curve.append((at, heldout_pass(trainer.model, trainer.tokenizer, cfg, trainer.task)))
    return {"curve": curve, "curve_versions": [v for _, v, _ in copies],
            "step_times": step_times, "steps": trainer.version, "lags": lags,
            "fingerprint_mismatches": mismatched, "samples": generated,
            "seconds": copies[-1][0], "cores": [gen_core, learn_core]}


def seeds_arg(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def compare(seeds: list[int], overrides: list[str]) -> list[dict]:
    """Per seed: ShardRL's run (`trl_bench.run_shardrl`, evaluated every 2 versions after its
    training), then the one-thread loop and this trainer from its snapshot for as long; each
    one's time to the loop's 70% target (crossings read between evaluations) and versions."""
    from bench.curves import ratio, time_to_reach_interpolated, time_to_target
    from bench.trl_bench import discard_run, peer_process, run_shardrl

    base = ["tracking.enabled=false", "eval.every=2", "eval.when=after",
            "learner.total_steps=240"]
    rows = []
    for seed in seeds:
        ov = [*base, *overrides, f"seed={seed}"]
        run_id = f"two-process-{int(time.time())}-{seed}"
        s = run_shardrl("demo", ov, run_id)
        points = len(s["curve"]) - 1
        loop = peer_process("sync", "demo", ov, s["snapshot"], s["seconds"], points,
                            ["--threads", "1", "--eval-after"])
        two = peer_process("two_process", "demo", ov, s["snapshot"], s["seconds"], points)
        discard_run(run_id, s["snapshot"])
        reached = time_to_target(loop["curve"], s["curve"], two["curve"])
        target = reached["target"]
        row = {"seed": seed, "target": target}
        version_curves = [[(float(v), p) for v, (_, p) in zip(r["curve_versions"], r["curve"],
                                                               strict=True)]
                          for r in (loop, two)]
        v10 = [r["step_times"][9] if len(r["step_times"]) > 9 else None for r in (loop, two)]
        sides = zip(("loop", "shardrl", "two_process"), reached["crossing"],
                    (version_curves[0], s["version_curve"], version_curves[1]),
                    (v10[0], s["version_times"].get(10), v10[1]), strict=True)
        for name, seconds, versions, at10 in sides:
            row[name] = {"seconds": seconds, "v10_s": at10,
                         "versions": None if target is None
                         else time_to_reach_interpolated(versions, target)}
        for name in ("shardrl", "two_process"):
            row[name]["speedup"] = ratio(row["loop"]["seconds"], row[name]["seconds"])
        row["two_process"]["max_lag"] = max(two["lags"])
        row["two_process"]["fingerprint_mismatches"] = two["fingerprint_mismatches"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    for name in ("shardrl", "two_process"):
        ups = [r[name]["speedup"] for r in rows if r[name]["speedup"]]
        if ups:
            print(f"{name}: time to the loop's target, loop / {name}: median "
                  f"{statistics.median(ups):.2f}x ({min(ups):.2f}x to {max(ups):.2f}x, "
                  f"{len(ups)} of {len(rows)} seeds)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override")
    parser.add_argument("--snapshot", type=Path, help="HF folder to start from")
    parser.add_argument("--budget", type=float, help="seconds of clock")
    parser.add_argument("--eval-points", type=int, default=6)
    parser.add_argument("--out", type=Path, help="JSON written here")
    parser.add_argument("--eval-after", action="store_true",
                        help="accepted for the peers' common command line: always after")
    parser.add_argument("--compare", type=seeds_arg, metavar="SEEDS",
                        help="e.g. 0-4: ShardRL, the loop and this trainer on each seed")
    args = parser.parse_args()
    from bench.sync_baseline import passive_openmp

    passive_openmp()
    if args.compare is not None:
        compare(args.compare, args.overrides)
        return
    if args.snapshot is None or args.budget is None or args.out is None:
        parser.error("give --snapshot, --budget and --out (or --compare SEEDS)")
    result = run_two_process(args.config, args.overrides, args.snapshot, args.budget,
                             args.eval_points)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
