"""LocalStore specifics: temp files stay invisible and listing matches a brute-force filter."""

import errno
import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrl.store import LocalStore
from shardrl.store.base import StoreError


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


linux = pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc")


def _record_fsyncs(monkeypatch, root):
    """Each fsync of the store as (path, names in it when it is a folder)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        names = sorted(os.listdir(path)) if os.path.isdir(path) else None
        synced.append((os.path.relpath(path, root), names))
        real(fd)

    monkeypatch.setattr("shardrl.store.local.os.fsync", fsync)
    return synced


@linux
def test_a_write_syncs_its_file_then_its_name_and_its_folders_names(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    synced = _record_fsyncs(monkeypatch, tmp_path / "store")
    store.put_bytes("a/b/c.json", b"{}")
    # the names of the new folders and of the store's own, each in its parent, then the
    # temp file's bytes, then the folder that holds the key's name once the rename made it
    assert synced[:3] == [("a", ["b"]), (".", ["a"]), ("..", ["store"])]
    assert synced[3][0].startswith("a/b/.c.json.") and synced[3][1] is None
    assert synced[4:] == [("a/b", ["c.json"])]

    synced.clear()
    store.put_bytes("a/b/d.json", b"{}")  # the folders are known durable: file, then name
    assert [p for p, _ in synced][1:] == ["a/b"] and synced[1][1] == ["c.json", "d.json"]

    synced.clear()
    assert store.put_if_absent("a/e.json", b"1")  # a link, synced as a rename is
    assert synced[-1] == ("a", ["b", "e.json"]) and len(synced) == 2


@linux
def test_a_folder_made_by_another_is_synced_by_its_first_write_here(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.put_bytes("x.json", b"{}")
    (tmp_path / "ready" / "v1").mkdir(parents=True)  # as a watch or another process makes it
    synced = _record_fsyncs(monkeypatch, tmp_path)
    store.put_bytes("ready/v1/s.parquet", b"1")
    assert [p for p, _ in synced][:2] == ["ready", "."] and synced[-1][0] == "ready/v1"


@linux
def test_a_file_system_that_cannot_sync_folders_is_warned_of_once(tmp_path, monkeypatch,
                                                                   caplog):
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr("shardrl.store.local.os.fsync", fsync)
    monkeypatch.setattr("shardrl.store.local._unsynced_warned", False)
    store = LocalStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shardrl.store"):
        store.put_bytes("a/x", b"1")
        store.put_bytes("a/y", b"2")
    assert store.get_bytes("a/y") == b"2"
    warned = [r.message for r in caplog.records if "cannot sync folders" in r.message]
    assert len(warned) == 1
    assert warned[0] == (f"the file system of {tmp_path} cannot sync folders ([Errno 22] "
                         "Invalid argument): an object written there survives a crash of "
                         "its writer, not of the machine")

    def failing(fd):  # any other error of a folder's sync fails the write
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr("shardrl.store.local.os.fsync", failing)
    with pytest.raises(StoreError, match="cannot write 'a/z'.*Input/output error"):
        store.put_bytes("a/z", b"3")
    assert store.get_bytes("a/z") == b"3"  # renamed, but not known durable: the write raised


def test_a_file_where_a_folder_would_be_is_a_store_error(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("a", b"x")
    with pytest.raises(StoreError, match="cannot write 'a/b'"):
        store.put_bytes("a/b", b"y")
    with pytest.raises(StoreError):  # not "someone else wrote it first"
        store.put_if_absent("a/b", b"y")
    assert store.list() == ["a"]
