"""Benchmark: write + read of a rollout shard through `shardrl.store` versus raw put/get.

A 512-row rollout shard (256 prompt + 256 response tokens per row, groups of 8) is
written with `write_shard` and read back with `read_shard` on a folder store and on S3
(a throwaway SeaweedFS server, or the one named by S3_ENDPOINT_URL/SHARDRL_BENCH_BUCKET).
Beside it, `put_bytes`/`get_bytes` move raw payloads of two sizes:

- `ratio` (equal payload): raw put+get of as many bytes as the table holds in memory, over
  the shard's write+read. Throughput counts that in-memory size, so both move the same
  table; the shard's Parquet file is smaller (compressed), which the shard gains from.
- `ratio_equal_bytes`: raw put+get of as many bytes as the shard's Parquet file, over the
  shard's write+read: both move the same bytes through the store, so what it measures is
  the cost of encoding and decoding the shard (and its checks) on top of the transfer.

Target: shard throughput >= 0.5 x raw. Run `python bench/store_bench.py`; the figures
are printed and merged under the key "store" into bench/results.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.results import RESULTS, merge_results
from shardrl.store import LocalStore, RunKeys, Store, read_shard, write_shard
from shardrl.store.s3 import S3Store
from shardrl.store.schemas import ROLLOUT
from shardrl.store.shards import decode_shard, encode_shard

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.5
VOCAB, ROWS, PROMPT_LEN, RESPONSE_LEN, GROUP = 32_000, 512, 256, 256, 8
WORDS = ["the", "sum", "of", "7", "and", "12", "is", "19", "so", "answer", "we", "add", "carry"]


def rollout_table(seed: int = 0) -> pa.Table:
    """ROWS rollout rows with Zipf-distributed token ids and exponential negative logprobs."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, VOCAB + 1)
    prompts = ROWS // GROUP
    prompt_ids = rng.choice(VOCAB, (prompts, PROMPT_LEN), p=zipf / zipf.sum()).astype(np.int32)
    response_ids = rng.choice(VOCAB, (ROWS, RESPONSE_LEN), p=zipf / zipf.sum()).astype(np.int32)
    logprobs = -rng.exponential(0.7, (ROWS, RESPONSE_LEN)).astype(np.float32)
    prompt_text = [" ".join(rng.choice(WORDS, PROMPT_LEN)) for _ in range(prompts)]
    response_text = [" ".join(rng.choice(WORDS, RESPONSE_LEN)) for _ in range(ROWS)]
    group = np.arange(ROWS) // GROUP

    def lists(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
        offsets = np.arange(0, matrix.size + 1, matrix.shape[1], dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(matrix.ravel(), value_type))

    return pa.table({
        "prompt_id": [f"add-{g:05d}" for g in group],
        "group_id": [f"v3-w00-{g:05d}" for g in group],
        "sample_idx": pa.array(np.arange(ROWS) % GROUP, pa.int32()),
        "policy_version": pa.array(np.full(ROWS, 3), pa.int64()),
        "worker": pa.array(np.zeros(ROWS), pa.int32()),
        "prompt_text": [prompt_text[g] for g in group],
        "prompt_token_ids": lists(prompt_ids[group], pa.int32()),
        "response_token_ids": lists(response_ids, pa.int32()),
        "behavior_logprobs": lists(logprobs, pa.float32()),
        "finish_reason": rng.choice(["stop", "length"], ROWS, p=[0.8, 0.2]).tolist(),
        "response_text": response_text,
        "answer": [str(int(g) % 100) for g in group],
        "category": ["add"] * ROWS,
        "created_at": np.full(ROWS, 1.7e9) + np.arange(ROWS) * 1e-3,
    }, schema=ROLLOUT)


def measure(store: Store, table: pa.Table, repeats: int) -> dict[str, float]:
    """Median ms of shard write/read and of raw put/get of the same payload on `store`.

    `raw_*` moves as many bytes as the table holds in memory, `file_*` as many as its
    Parquet file. The operations are interleaved within each repeat, so a neighbour's
    load slows all of them alike; the first repeat is a warm-up and is not counted.
    """
    rk = RunKeys("bench")
    shard = encode_shard(table, ROLLOUT)
    payloads = {
        "raw": np.random.default_rng(1).bytes(table.nbytes),
        "file": np.random.default_rng(2).bytes(len(shard)),
    }
    ops: dict[str, Callable[[int], object]] = {
        "shard_write": lambda i: write_shard(store, rk.rollout(3, 0, i), table, ROLLOUT),
        "shard_read": lambda i: read_shard(store, rk.rollout(3, 0, i), ROLLOUT),
        "encode": lambda i: encode_shard(table, ROLLOUT),  # the Parquet codec alone, in memory
        "decode": lambda i: decode_shard(shard, ROLLOUT),
    }
    for name, payload in payloads.items():
        ops[f"{name}_put"] = lambda i, n=name, p=payload: store.put_bytes(f"{n}/{i}", p)
        ops[f"{name}_get"] = lambda i, n=name: store.get_bytes(f"{n}/{i}")
    times: dict[str, list[float]] = {op: [] for op in ops}
    for i in range(repeats + 1):
        for op, fn in ops.items():
            start = time.perf_counter()
            fn(i)
            if i > 0:
                times[op].append(time.perf_counter() - start)
    for key in store.list("runs/bench/") + store.list("raw/") + store.list("file/"):
        store.delete(key)
    result = {f"{op}_ms": 1e3 * statistics.median(t) for op, t in times.items()}
    return result | {"shard_bytes": len(shard)}


@contextmanager
def s3_store() -> Iterator[S3Store]:
    """The bucket named by the environment, else one on a throwaway SeaweedFS server."""
    bucket = os.environ.get("SHARDRL_BENCH_BUCKET")
    if bucket:
        yield S3Store.from_uri(f"s3://{bucket}/store-bench")
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from seaweed import seaweed_server  # the test suite's throwaway server

    with tempfile.TemporaryDirectory() as folder, seaweed_server(Path(folder)) as server:
        server.make_bucket("bench")
        yield S3Store("bench", "store-bench", server.endpoint, server.access_key, server.secret_key)


def summarize(name: str, r: dict[str, float], nbytes: int) -> dict[str, float | bool]:
    """Throughputs in MB/s of the in-memory payload and the shard/raw ratios."""
    def mbps(ms: float) -> float:
        return round(nbytes / 1e6 / (ms / 1e3), 1)

    shard = r["shard_write_ms"] + r["shard_read_ms"]
    raw = r["raw_put_ms"] + r["raw_get_ms"]
    file = r["file_put_ms"] + r["file_get_ms"]
    out = {k: round(v, 2) for k, v in r.items()}
    out |= {
        "shard_write_read_MBps": mbps(shard), "raw_put_get_MBps": mbps(raw),
        "ratio_write": round(r["raw_put_ms"] / r["shard_write_ms"], 3),
        "ratio_read": round(r["raw_get_ms"] / r["shard_read_ms"], 3),
        "ratio": round(raw / shard, 3),
        "ratio_equal_bytes": round(file / shard, 3),
        "ratio_write_equal_bytes": round(r["file_put_ms"] / r["shard_write_ms"], 3),
        "ratio_read_equal_bytes": round(r["file_get_ms"] / r["shard_read_ms"], 3),
    }
    out["within_target"] = out["ratio"] >= TARGET_RATIO
    out["within_target_equal_bytes"] = out["ratio_equal_bytes"] >= TARGET_RATIO
    print(f"{name:6} {r['shard_write_ms']:9.1f} {r['shard_read_ms']:9.1f} {r['raw_put_ms']:9.1f} "
          f"{r['raw_get_ms']:9.1f} {file:9.1f} {out['shard_write_read_MBps']:10.1f} "
          f"{out['raw_put_get_MBps']:9.1f} {out['ratio']:6.3f} {out['ratio_equal_bytes']:6.3f} "
          f"{r['encode_ms']:6.1f} {r['decode_ms']:6.1f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--no-s3", action="store_true", help="measure the folder store only")
    args = parser.parse_args()

    table = rollout_table()
    print(f"rollout shard: {ROWS} rows, {PROMPT_LEN}+{RESPONSE_LEN} tokens/row, "
          f"{table.nbytes / 1e6:.2f} MB in memory; median of {args.repeats}")
    print(f"shard: write_shard / read_shard; raw: put/get of {table.nbytes} bytes; "
          "file: put+get of the Parquet file's size; ratio = raw time / shard time; "
          "r.file = file time / shard time (equal bytes); enc/dec: the Parquet codec alone")
    print(f"{'store':6} {'write ms':>9} {'read ms':>9} {'put ms':>9} {'get ms':>9} "
          f"{'file ms':>9} {'shard MB/s':>10} {'raw MB/s':>9} {'ratio':>6} {'r.file':>6} "
          f"{'enc ms':>6} {'dec ms':>6}")
    backends: dict[str, dict[str, float | bool]] = {}
    with tempfile.TemporaryDirectory() as folder:
        backends["local"] = summarize(
            "local", measure(LocalStore(folder), table, args.repeats), table.nbytes
        )
    if not args.no_s3:
        with s3_store() as store:
            backends["s3"] = summarize("s3", measure(store, table, args.repeats), table.nbytes)

    merge_results("store", {
        "rows": ROWS, "prompt_tokens": PROMPT_LEN, "response_tokens": RESPONSE_LEN,
        "table_bytes": table.nbytes, "repeats": args.repeats, "target_ratio": TARGET_RATIO,
        "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2),
        "backends": backends,
    })
    print(f"merged under 'store' into {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
