"""Parquet shards validated against the boundary schemas, quarantine, and column helpers.

A shard is one immutable Parquet file (LZ4, see `CODEC`) whose columns match a schema of
`shardrl.store.schemas` exactly: same names, same order, same types. Safe differences
are cast on the way (int64 -> int32 when every value fits, float64 -> float32 when no
finite value overflows, large_string -> string, an all-null column -> any nullable type);
anything else is a SchemaError. The boundary schemas from rollout on may be followed by all
of `schemas.EPISODE`'s columns (multi-turn episodes), checked the same way. A shard that
cannot be read or violates its schema is moved to quarantine with an `.error.json` beside it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardrl.store.base import NotFound, Store
from shardrl.store.keys import RunKeys, ShardKind, error_key, parse_shard_key, quarantine_key
from shardrl.store.schemas import EPISODE, ROLLOUT

log = logging.getLogger("shardrl.store")


def shards_by_name(store: Store, keys: RunKeys, kinds: tuple[ShardKind, ...]) -> dict[str, str]:
    """Every shard name (`ShardKey.name`) under the run's `kinds` -> its key in the first of
    `kinds` that has it. A shard's rows are the same in each of its kinds, so ("rollouts",
    "ready") finds every generated shard also when a worker with inline post-processing
    wrote the ready shard alone (`rollout.inline_shards`)."""
    out: dict[str, str] = {}
    for kind in kinds:
        for key in store.list(keys.kind_prefix(kind)):
            if key.endswith(".parquet"):
                out.setdefault(parse_shard_key(key).name, key)
    return out


class ShardError(Exception):
    """A shard cannot be used by the stage that reads it."""


class CorruptShard(ShardError):
    """The object is not a readable Parquet file."""


class SchemaError(ShardError):
    """The table does not match the boundary schema."""


def _is_list(type_: pa.DataType) -> bool:
    return pa.types.is_list(type_) or pa.types.is_large_list(type_)


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a column of type `src` may be cast to `dst` (range checks happen on cast)."""
    if pa.types.is_null(src):
        return True
    if pa.types.is_integer(src):
        return pa.types.is_integer(dst) or pa.types.is_floating(dst)
    if pa.types.is_floating(src):
        return pa.types.is_floating(dst)
    if pa.types.is_string(src) or pa.types.is_large_string(src):
        return pa.types.is_string(dst) or pa.types.is_large_string(dst)
    if _is_list(src):
        return _is_list(dst) and _castable(
            src.value_type, dst.value_type
        )
    return False


def _leaves(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The innermost values of a (possibly nested) list column."""
    while _is_list(column.type):
        column = pc.list_flatten(column)
    return column


def _cast_column(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """`column` as `field.type`, or SchemaError when the cast would lose information."""
    if column.type == field.type:
        return column
    if not _castable(column.type, field.type):
        raise SchemaError(f"column {field.name!r} has type {column.type}, expected {field.type}")
    try:
        cast = column.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SchemaError(
            f"column {field.name!r} cannot be cast from {column.type} to {field.type} "
            f"without loss: {e}"
        ) from e
    before, after = _leaves(column), _leaves(cast)
    if pa.types.is_floating(before.type) and pa.types.is_floating(after.type):
        if pc.sum(pc.is_inf(after)).as_py() != pc.sum(pc.is_inf(before)).as_py():
            raise SchemaError(
                f"column {field.name!r}: values overflow when cast from {column.type} "
                f"to {field.type}"
            )
    return cast


def conform(table: pa.Table, schema: pa.Schema, episodic: bool | None = None) -> pa.Table:
    """`table` with exactly `schema`: same column names and order, types cast safely.

    Raises SchemaError naming the missing, unexpected or mistyped columns, or a
    non-nullable column that holds nulls. A shard schema from rollout on (or any schema,
    with `episodic`: some of such a shard's columns) also takes the `EPISODE` columns, all
    or none, wherever they are: they come back after its own.
    """
    if episodic is None:
        episodic = schema.names[: len(ROLLOUT)] == ROLLOUT.names
    present = [n for n in EPISODE.names if n in table.column_names]
    if present and episodic:
        if len(present) < len(EPISODE):
            missing = [n for n in EPISODE.names if n not in present]
            raise SchemaError(f"episode columns come together: missing {missing}")
        episode = conform(table.select(present), EPISODE)
        base = conform(table.drop_columns(present), schema)
        return pa.Table.from_arrays(base.columns + episode.columns,
                                    schema=pa.schema(list(schema) + list(EPISODE)))
    if table.schema.equals(schema):  # typed as the shard's schema already: nothing to cast
        _check_nulls(table, schema)
        return table
    names, expected = table.column_names, schema.names
    if names != expected:
        missing = [n for n in expected if n not in names]
        extra = [n for n in names if n not in expected]
        if missing or extra:
            raise SchemaError(f"columns differ: missing {missing}, unexpected {extra}")
        raise SchemaError(f"columns in the wrong order: expected {expected}, got {names}")
    columns = [_cast_column(column, field)
               for field, column in zip(schema, table.columns, strict=True)]
    table = pa.Table.from_arrays(columns, schema=schema)
    _check_nulls(table, schema)
    return table


def _check_nulls(table: pa.Table, schema: pa.Schema) -> None:
    """SchemaError if a column that `schema` makes non-nullable holds nulls, or a list
    column (token ids, logprobs: one per token) holds a null item in a list: every reader
    pads them into tensors, which have no null."""
    for field, column in zip(schema, table.columns, strict=True):
        if not field.nullable and column.null_count:
            raise SchemaError(f"column {field.name!r} must not be null ({column.null_count} nulls)")
        if pa.types.is_list(field.type) and (items := pc.list_flatten(column).null_count):
            raise SchemaError(f"column {field.name!r} holds {items} null item(s) in its lists")


CODEC = "lz4"
"""Parquet compression of the shards written. A generated shard is written once (its ready
shard, with inline post-processing) or three times (rollouts, scored, ready: the score and
prepare stages, or `rollout.inline_shards: all`) and read by the next stage, on the cores
that generate and train, and most of its bytes are token ids and float logprobs, which
compress little. Measured on the demo's shards, LZ4 encodes and decodes in under half the
time of zstd for 6-10% more bytes (with three writes, about 2.6 ms of CPU saved per
generated shard, 1.9 writing them and 0.7 reading the ready one, some 10% of what a shard
cost end to end); on SmolLM2's, 4% more bytes. Readers take any codec: shards written with zstd read alike."""


def encode_shard(table: pa.Table, schema: pa.Schema) -> bytes:
    """Parquet (`CODEC`) bytes of `table` conformed to `schema`."""
    # No dictionary encoding and no min/max statistics, on any column: no reader filters on
    # statistics, and LZ4 already folds the values a group repeats (prompt text, ids). On
    # the demo's ready shards (128 rows) the scalar columns' dictionaries and statistics
    # took a third of the encoding time and made the file larger (8.8 KB against 7.6 KB).
    sink = pa.BufferOutputStream()
    pq.write_table(conform(table, schema), sink, compression=CODEC, use_dictionary=False,
                   write_statistics=False)
    return sink.getvalue().to_pybytes()


THREADED_READ = 1 << 20
"""Bytes above which a shard's columns are decoded on Arrow's thread pool."""


def read_columns(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """`columns` (None: all) of the Parquet file in `data`, unvalidated: what `decode_shard`
    conforms, and what readers that take a few columns of many small files use (metric
    chunks, scored shards).

    Not `pq.read_table`: its first call imports Arrow's dataset modules, 0.26-0.35 s of a
    small core, which would land on whatever process reads first (the live doctor's first
    check, while the learner waits to commit; the MLflow forwarder in the runner); and each
    call after costs about ten times this one on a small file. Arrow's thread pool only for
    large files: on a small one (a demo shard, 8 KB) it costs more than it saves (0.6 ms
    against 1.1 ms to read one)."""
    return pq.ParquetFile(pa.BufferReader(data)).read(columns=columns,
                                                       use_threads=len(data) > THREADED_READ)


def decode_shard(data: bytes, schema: pa.Schema, columns: list[str] | None = None,
                 ) -> pa.Table:
    """The table in Parquet bytes, conformed to `schema`; CorruptShard or SchemaError.

    With `columns` (names of `schema`'s), only those are decoded, in that order, each
    checked against its field of `schema`, followed by the `EPISODE` columns when the shard
    has them (all or none): a reader that uses a few columns of a wide shard decodes only
    them (the learner trains on 11 of a ready shard's 24, 0.3 ms a demo shard against 0.47
    for all of them). A column the shard lacks is a SchemaError, as it is without `columns`."""
    try:
        if columns is None:
            table = read_columns(data)
        else:
            file = pq.ParquetFile(pa.BufferReader(data))
            names = set(file.schema_arrow.names)
            missing = [c for c in columns if c not in names]
            if missing:
                raise SchemaError(f"columns differ: missing {missing}")
            wanted = columns + [n for n in EPISODE.names if n in names]
            table = file.read(columns=wanted, use_threads=len(data) > THREADED_READ)
    except (pa.ArrowException, OSError) as e:
        raise CorruptShard(f"not a readable Parquet file ({len(data)} bytes): {e}") from e
    if columns is None:
        return conform(table, schema)
    return conform(table, pa.schema([schema.field(c) for c in columns]), episodic=True)


def write_shard(store: Store, key: str, table: pa.Table, schema: pa.Schema) -> None:
    """Validate `table` against `schema` and write it as one Parquet object at `key`."""
    try:
        data = encode_shard(table, schema)
    except SchemaError as e:
        raise SchemaError(f"cannot write {key!r}: {e}") from e
    store.put_bytes(key, data)


def read_shard(store: Store, key: str, schema: pa.Schema, columns: list[str] | None = None,
               ) -> pa.Table:
    """Read the shard at `key` and validate it against `schema` (its `columns` alone, when
    given: `decode_shard`)."""
    data = store.get_bytes(key)
    try:
        return decode_shard(data, schema, columns)
    except ShardError as e:
        raise type(e)(f"shard {key!r} in {store.uri}: {e}") from e


def quarantine(store: Store, key: str, stage: str, error: BaseException) -> str:
    """Move `key` to quarantine with an `.error.json` beside it; return the new key.

    The copy and the error file are written before the original is deleted, so a crash
    in between leaves the shard in both places, never in neither.
    """
    target = quarantine_key(key, stage)
    try:
        data: bytes | None = store.get_bytes(key)
    except NotFound:
        data = None  # already moved, or gone: record the error anyway
    if data is not None:
        store.put_bytes(target, data)
    store.put_json(error_key(target), {
        "error_type": type(error).__name__,
        "message": str(error),
        "stage": stage,
        "time": time.time(),
        "original_key": key,
        "size_bytes": None if data is None else len(data),
    })
    store.delete(key)
    log.warning("quarantined %s as %s (%s: %s)", key, target, type(error).__name__, error)
    return target


def read_or_quarantine(store: Store, key: str, schema: pa.Schema, stage: str,
                       columns: list[str] | None = None) -> pa.Table | None:
    """`read_shard`, except that an unusable shard is quarantined and None is returned."""
    try:
        return read_shard(store, key, schema, columns)
    except ShardError as e:
        quarantine(store, key, stage, e)
        return None


def list_column_to_padded(
    table: pa.Table, column: str, pad: float | int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A list column as a right-padded matrix, built from the Arrow offsets without a row loop.

    Returns `padded (B, T)` with row i's values in `padded[i, :lengths[i]]` and `pad` after,
    and `lengths (B,)` int64. T is `width` if given, else the longest row. The dtype is
    that of the list values (int32 for token ids, float32 for logprobs).
    """
    array = table.column(column).combine_chunks()
    if not _is_list(array.type):
        raise ValueError(f"column {column!r} is {array.type}, not a list column")
    values = array.flatten()
    if array.null_count or values.null_count:
        raise ValueError(f"column {column!r} holds nulls; cannot pad it")
    offsets = array.offsets.to_numpy()                               # (B + 1,)
    lengths = np.diff(offsets).astype(np.int64)                      # (B,)
    flat = values.to_numpy(zero_copy_only=False)                     # (sum(lengths),)
    longest = int(lengths.max(initial=0))
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"column {column!r} has a row of {longest} values > width {width}")
    padded = np.full((len(array), width), pad, dtype=flat.dtype)    # (B, T)
    padded[np.arange(width)[None, :] < lengths[:, None]] = flat
    return padded, lengths


def padded_to_list_array(
    padded: np.ndarray, lengths: np.ndarray, value_type: pa.DataType | None = None
) -> pa.ListArray:
    """The inverse of `list_column_to_padded`: row i is `padded[i, :lengths[i]]`.

    `padded (B, T)`, `lengths (B,)`; `value_type` defaults to the Arrow type of the dtype.
    """
    batch, width = padded.shape
    lengths = np.asarray(lengths, dtype=np.int64)                    # (B,)
    if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > width).any():
        raise ValueError(f"lengths must have shape ({batch},) with values in [0, {width}]")
    values = padded[np.arange(width)[None, :] < lengths[:, None]]   # (sum(lengths),)
    offsets = np.zeros(batch + 1, dtype=np.int32)                    # (B + 1,)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))
