"""LocalStore specifics: temp files stay invisible and listing matches a brute-force filter."""

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.store import LocalStore


def test_temp_files_of_writes_in_progress_are_never_listed(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("a/x.parquet", b"1")
    # What a concurrent writer's temp file looks like before its rename.
    (tmp_path / "a" / ".y.parquet.0123abcd.tmp").write_bytes(b"partial")
    assert store.list() == ["a/x.parquet"]
    assert sorted(os.listdir(tmp_path / "a")) == [".y.parquet.0123abcd.tmp", "x.parquet"]
    assert store.list("a/", start_after="a/w") == ["a/x.parquet"]


SEGMENT = st.sampled_from(["a", "b", "b0", "b.json", "c1", "v000010", "v000009"])
KEYS = st.lists(st.lists(SEGMENT, min_size=1, max_size=3).map("/".join), max_size=12)


@settings(max_examples=60, deadline=None)
@given(keys=KEYS, prefix=st.sampled_from(["", "a", "a/", "b", "b/b0/", "v0000"]),
       start_after=st.none() | st.lists(SEGMENT, min_size=1, max_size=3).map("/".join))
def test_list_equals_brute_force(tmp_path_factory, keys, prefix, start_after):
    root = tmp_path_factory.mktemp("store")
    store = LocalStore(root)
    written = set()
    for key in keys:
        # A key cannot also be a folder of other keys on a filesystem: skip such clashes.
        if any(k.startswith(key + "/") or key.startswith(k + "/") for k in written):
            continue
        store.put_bytes(key, b"")
        written.add(key)
    expected = sorted(
        k for k in written if k.startswith(prefix) and (start_after is None or k > start_after)
    )
    assert store.list(prefix, start_after) == expected
