"""Boundary schemas, schema conformance, Parquet encoding and the padding helpers."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardrl.store.schemas import EPISODE, EVAL, METRICS, READY, ROLLOUT, SCORED
from shardrl.store.shards import (
    CorruptShard,
    SchemaError,
    conform,
    decode_shard,
    encode_shard,
    list_column_to_padded,
    padded_to_list_array,
    read_columns,
)

SMALL = pa.schema([
    pa.field("id", pa.int32(), nullable=False),
    pa.field("score", pa.float32(), nullable=True),
    pa.field("tokens", pa.list_(pa.int32()), nullable=False),
])


def test_later_stages_only_add_columns():
    for earlier, later in [(ROLLOUT, SCORED), (SCORED, READY)]:
        assert list(later)[: len(earlier)] == list(earlier)
        assert len(later) > len(earlier)
    assert SCORED.names[len(ROLLOUT):] == [
        "reward_verifier", "reward_model", "reward_rm", "correct", "reward_error", "ref_logprobs",
    ]
    assert READY.names[len(SCORED):] == ["reward_total", "advantage", "keep", "filter_reason"]
    assert ROLLOUT.field("response_token_ids").type == pa.list_(pa.int32())
    assert not ROLLOUT.field("prompt_id").nullable and SCORED.field("ref_logprobs").nullable
    assert EVAL.names[0] == "policy_version" and METRICS.names == [
        "stage", "name", "step", "value", "time",
    ]


def test_safe_casts_are_applied():
    # Plain Python lists infer int64 / double; every value fits int32 / float32.
    table = pa.table({"id": [1, 2], "score": [0.5, None], "tokens": [[1, 2], []]})
    out = conform(table, SMALL)
    assert out.schema == SMALL
    assert out.to_pylist() == [
        {"id": 1, "score": 0.5, "tokens": [1, 2]}, {"id": 2, "score": None, "tokens": []},
    ]
    all_null = pa.table({"id": [1], "score": pa.array([None]), "tokens": [[3]]})
    assert conform(all_null, SMALL).column("score").type == pa.float32()


@pytest.mark.parametrize(("columns", "message"), [
    ({"id": [2**31], "score": [0.5], "tokens": [[1]]}, "cannot be cast from int64 to int32"),
    ({"id": [1], "score": [1e300], "tokens": [[1]]}, "values overflow"),
    ({"id": [1], "score": [0.5], "tokens": [[2**40]]}, "'tokens' cannot be cast"),
    ({"id": ["1"], "score": [0.5], "tokens": [[1]]}, "'id' has type string, expected int32"),
    ({"id": [None], "score": [0.5], "tokens": [[1]]}, "'id' must not be null"),
    ({"id": [1], "tokens": [[1]]}, r"missing \['score'\], unexpected \[\]"),
    ({"id": [1], "score": [0.5], "tokens": [[1]], "x": [1]}, r"unexpected \['x'\]"),
    ({"score": [0.5], "id": [1], "tokens": [[1]]}, "wrong order"),
])
def test_violations_raise_schema_error(columns, message):
    with pytest.raises(SchemaError, match=message):
        conform(pa.table(columns), SMALL)


def test_a_table_already_typed_as_the_schema_is_kept_and_still_checked_for_nulls():
    typed = pa.table({"id": pa.array([1], pa.int32()), "score": pa.array([None], pa.float32()),
                      "tokens": pa.array([[3]], pa.list_(pa.int32()))}, schema=SMALL)
    assert conform(typed, SMALL) is typed  # nothing to cast: the same table back
    # the schema says non-nullable, the data holds a null (Arrow does not enforce it)
    holed = pa.table({"id": pa.array([None], pa.int32()), "score": pa.array([0.5], pa.float32()),
                      "tokens": pa.array([[3]], pa.list_(pa.int32()))}, schema=SMALL)
    assert holed.schema.equals(SMALL)
    with pytest.raises(SchemaError, match="'id' must not be null"):
        conform(holed, SMALL)


def test_encode_decode_round_trip_and_corruption():
    table = conform(pa.table({"id": [7], "score": [None], "tokens": [[4, 5]]}), SMALL)
    data = encode_shard(table, SMALL)
    assert data[:4] == b"PAR1"
    assert decode_shard(data, SMALL).equals(table)
    with pytest.raises(CorruptShard, match="not a readable Parquet file"):
        decode_shard(data[: len(data) // 2], SMALL)


def one_row(schema: pa.Schema) -> dict:
    """A value for each field of `schema`, typed loosely (ints as int64), as a writer might."""
    def value(t: pa.DataType):
        if pa.types.is_list(t):
            return [value(t.value_type)]
        if pa.types.is_boolean(t):
            return True
        if pa.types.is_integer(t):
            return 3
        if pa.types.is_floating(t):
            return 0.5
        return "s"
    return {f.name: [value(f.type)] for f in schema}


def parquet(columns: dict) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


def test_decode_shard_reads_only_the_named_columns_and_checks_them():
    wanted = ["keep", "policy_version", "response_token_ids"]
    out = decode_shard(parquet(one_row(READY)), READY, wanted)
    assert out.column_names == wanted  # in the order asked, not the file's
    assert out.schema == pa.schema([READY.field(c) for c in wanted])  # int64 cast to int32
    assert out.to_pylist() == [{"keep": True, "policy_version": 3, "response_token_ids": [3]}]
    # a multi-turn shard's episode columns follow, all of them or none
    episode = decode_shard(parquet(one_row(READY) | one_row(EPISODE)), READY, wanted)
    assert episode.column_names == wanted + EPISODE.names
    assert episode.schema == pa.schema([READY.field(c) for c in wanted] + list(EPISODE))
    partial = one_row(READY) | {"policy_mask": [[1]]}
    with pytest.raises(SchemaError, match="episode columns come together"):
        decode_shard(parquet(partial), READY, wanted)
    # a column asked for that the shard lacks, or one of the wrong type, is a schema error
    lacking = {k: v for k, v in one_row(READY).items() if k != "keep"}
    with pytest.raises(SchemaError, match=r"missing \['keep'\]"):
        decode_shard(parquet(lacking), READY, wanted)
    with pytest.raises(SchemaError, match="'keep' has type string"):
        decode_shard(parquet(one_row(READY) | {"keep": ["yes"]}), READY, wanted)
    with pytest.raises(CorruptShard):
        decode_shard(b"PAR1 not parquet", READY, wanted)


def test_list_column_to_padded_uses_offsets_of_chunked_and_sliced_columns():
    chunk = pa.array([[9], [1, 2, 3], [], [4, 5]], pa.list_(pa.int32()))
    # Two chunks, the first sliced to rows 1..3: rows are [1, 2, 3], [], [4, 5], [6].
    column = pa.chunked_array([chunk.slice(1), pa.array([[6]], pa.list_(pa.int32()))])
    table = pa.table({"t": column})
    padded, lengths = list_column_to_padded(table, "t", pad=-1)
    assert padded.dtype == np.int32 and lengths.tolist() == [3, 0, 2, 1]
    assert padded.tolist() == [[1, 2, 3], [-1, -1, -1], [4, 5, -1], [6, -1, -1]]
    wide, _ = list_column_to_padded(table, "t", pad=0, width=5)
    assert wide.shape == (4, 5) and wide[0].tolist() == [1, 2, 3, 0, 0]
    with pytest.raises(ValueError, match="width 2"):
        list_column_to_padded(table, "t", pad=0, width=2)
    with pytest.raises(ValueError, match="holds nulls"):
        list_column_to_padded(pa.table({"t": pa.array([[1], None])}), "t", pad=0)


def test_padded_to_list_array_inverts_padding():
    padded = np.array([[-0.5, -1.0, 9.0], [9.0, 9.0, 9.0], [-2.0, 9.0, 9.0]], np.float32)
    array = padded_to_list_array(padded, np.array([2, 0, 1]))
    assert array.type == pa.list_(pa.float32())
    assert array.to_pylist() == [[-0.5, -1.0], [], [-2.0]]
    back, lengths = list_column_to_padded(pa.table({"x": array}), "x", pad=9.0, width=3)
    assert np.array_equal(back, padded) and lengths.tolist() == [2, 0, 1]
    with pytest.raises(ValueError):
        padded_to_list_array(padded, np.array([4, 0, 1]))


def test_read_columns_reads_the_named_columns_without_arrow_datasets(tmp_path):
    """The metric readers' path: only the columns asked for, in their order, and no import
    of Arrow's dataset modules (a third of a second on the first reader's core)."""
    table = pa.table({"stage": ["learn"] * 3, "name": ["a", "b", "a"], "step": [1, 1, 2],
                      "value": [0.5, 1.5, 2.5], "time": [10.0, 10.0, 11.0]})
    data = encode_shard(table, METRICS)
    got = read_columns(data, ["value", "name"])
    assert got.column_names == ["value", "name"]
    assert got.column("value").to_pylist() == [0.5, 1.5, 2.5]
    assert got.column("name").to_pylist() == ["a", "b", "a"]
    path = tmp_path / "chunk.parquet"
    path.write_bytes(data)
    script = (
        "import sys\n"
        "from shardrl.doctor.series import read_chunk\n"
        "from shardrl.store import LocalStore\n"
        f"points = read_chunk(LocalStore({str(tmp_path)!r}), 'chunk.parquet')\n"
        "assert points == [('a', 1, 0.5), ('b', 1, 1.5), ('a', 2, 2.5)], points\n"
        "print(sorted(m for m in sys.modules if m.startswith('pyarrow.dataset')"
        " or m.startswith('pyarrow._dataset')))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
