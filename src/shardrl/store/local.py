"""`LocalStore`: a folder as object store (the embedded default on one machine).

A write goes to a temp file in the destination's folder, is fsynced, then renamed over
the key (`os.replace` is atomic on POSIX), so readers never see a partial object and
several processes can write distinct keys at once. The folder is fsynced after the rename,
and the folder's own name in its parent (up to the root) the first time a process writes
there, so a write that returned survives a crash of the machine too, not only of its
process: the file's own fsync makes its bytes durable but not its name. Deletes are not
synced: after a machine's crash a deleted object may be back.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from shardrl.store.base import (
    NotFound,
    Store,
    StoreError,
    check_key,
    check_limit,
    check_prefix,
    check_range,
)

_TMP_SUFFIX = ".tmp"

log = logging.getLogger("shardrl.store")


_DURABLE: set[Path] = set()
"""Folders whose names, and those of the folders above them up to a store's root, are known
durable: synced by this process or by the one it was forked from. A folder's first write in
a process syncs them, whoever made the folder (another writer, a watch); later writes need
not. The store never removes a folder; one removed by hand and made again while a process
runs is not synced again by that process."""

_unsynced_warned = False


def _sync_folder(folder: Path) -> None:
    """fsync a folder: the names made, renamed or linked in it become durable. A file system
    that cannot sync a folder (EINVAL: some network and FUSE mounts) is left as it is, with
    one warning per process."""
    global _unsynced_warned
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        if not _unsynced_warned:
            _unsynced_warned = True
            log.warning("the file system of %s cannot sync folders (%s): an object written "
                        "there survives a crash of its writer, not of the machine", folder, e)
    finally:
        os.close(fd)


def _durable_folder(folder: Path, root: Path) -> None:
    """Make `folder` and its missing parents, then make its name and those of the folders
    above it, up to `root`'s own, durable, unless already known to be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a key's file where the folder would be
        raise NotADirectoryError(f"{folder} is not a folder") from None
    chain = []
    while folder not in _DURABLE:
        chain.append(folder)
        if folder == root:
            break
        folder = folder.parent
    for each in chain:
        if each == root:
            with suppress(PermissionError):  # the store's parent need not be readable
                _sync_folder(each.parent)
        else:
            _sync_folder(each.parent)
    _DURABLE.update(chain)


def _discard(tmp: Path) -> None:
    """Remove a failed write's temp file, if it was made (its folder may not be one)."""
    with suppress(FileNotFoundError, NotADirectoryError):
        tmp.unlink()


def _link_new(tmp: Path, path: Path) -> None:
    """Give the complete temp file the key's name only if no object has it (FileExistsError
    otherwise), then drop the temp name."""
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink()


class LocalStore(Store):
    """Objects are files under `root`; the key `a/b.json` is the file `root/a/b.json`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writer(key) as f:
            f.write(data)

    @contextmanager
    def writer(self, key: str, commit: Callable[[Path, Path], None] = os.replace,
               ) -> Iterator[IO[bytes]]:
        """A temp file beside the key's file, fsynced and renamed over it (`commit`) when the
        block ends without an error, then the folder fsynced; the temp file removed when the
        block raises (an `OSError`, from a write in the block too, as a `StoreError`;
        `commit`'s FileExistsError as it is). Should the folder's sync fail after the
        rename, the object exists but the write raises: it is not known durable."""
        path = self._path(key)
        # Temp names start with '.', which no key segment may, so list() never shows them.
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            _durable_folder(path.parent, self.root)
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            commit(tmp, path)
            _sync_folder(path.parent)
        except OSError as e:  # a write in the block too: the disk is full, say
            _discard(tmp)
            if isinstance(e, FileExistsError):  # `commit` found the key taken
                raise
            raise StoreError(f"cannot write {key!r} in {self.uri}: {e}") from e
        except BaseException:
            _discard(tmp)
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomic: the complete temp file is hard-linked to the key's name, which fails when
        the name exists, so of two writers at once exactly one writes."""
        try:
            with self.writer(key, commit=_link_new) as f:
                f.write(data)
        except FileExistsError:
            return False
        return True

    def sweep_temp(self, prefix: str) -> tuple[int, int]:
        """Remove the temp files under `prefix` of writers killed mid-write (never listed, so
        nothing else removes them; a killed checkpoint write leaves gigabytes). Only while no
        process writes under `prefix`: the local runner calls it before it starts a run's
        stages. (files removed, their bytes)."""
        count = size = 0
        folder = self.root.joinpath(*prefix.strip("/").split("/")) if prefix.strip("/") else self.root
        for path in folder.rglob(f".*{_TMP_SUFFIX}"):
            try:
                if path.is_file():
                    size += path.stat().st_size
                    path.unlink()
                    count += 1
            except OSError:  # removed meanwhile, or not ours to remove
                continue
        return count, size

    def watch(self, prefix: str, depth: int = 1):
        """Kernel notifications of commits (renames) under the folder `prefix` names."""
        from shardrl.store.watch import folder_watch

        check_prefix(prefix)
        base = prefix.rstrip("/")
        return folder_watch(self.root.joinpath(*base.split("/")) if base else self.root, depth)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise NotFound(f"no object {key!r} in {self.uri}") from e
        except OSError as e:
            raise StoreError(f"cannot read {key!r} in {self.uri}: {e}") from e

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset >= size:
                    return b""
                f.seek(offset)
                return f.read(min(length, size - offset))  # never a buffer past the end
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise NotFound(f"no object {key!r} in {self.uri}") from e
        except OSError as e:
            raise StoreError(f"cannot read {key!r} in {self.uri}: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except (IsADirectoryError, NotADirectoryError):
            return  # a folder of other keys, or a file where a folder would be: no such key
        except OSError as e:
            raise StoreError(f"cannot delete {key!r} in {self.uri}: {e}") from e

    def list(self, prefix: str = "", start_after: str | None = None,
             limit: int | None = None) -> list[str]:
        check_prefix(prefix)
        check_limit(limit)
        # Walk only the folder that holds every key with this prefix, in key order, so the
        # walk skips what sorts before start_after and stops once it has `limit` keys.
        base, _, partial = prefix.rpartition("/")
        top = self.root.joinpath(*base.split("/")) if base else self.root
        keys: list[str] = []
        self._walk(top, f"{base}/" if base else "", partial, start_after, limit, keys)
        return keys

    def _walk(self, folder: Path, rel: str, partial: str, start_after: str | None,
              limit: int | None, out: list[str]) -> bool:
        """Append to `out`, in key order, the keys under `folder` (whose key prefix is `rel`)
        whose rest starts with `partial` and that follow `start_after`; True once `out` holds
        `limit` keys."""
        try:
            with os.scandir(folder) as it:
                # A folder's keys sort as its name plus '/': order the entries as their keys.
                # Names starting with '.' are temp files of writes in progress.
                names = [e.name + "/" if e.is_dir(follow_symlinks=False) else e.name
                         for e in it if e.name[0] != "."]
        except (FileNotFoundError, NotADirectoryError):
            return False
        names.sort()
        first = bisect.bisect_left(names, partial)
        if start_after is not None:
            if start_after.startswith(rel):
                rest = start_after[len(rel):]
                after = bisect.bisect_right(names, rest)
                if after and names[after - 1].endswith("/") and rest.startswith(names[after - 1]):
                    after -= 1  # the folder start_after lies in: resume inside it
                first = max(first, after)
            elif start_after > rel:
                return False  # every key here sorts before start_after
        for i in range(first, len(names)):
            name = names[i]
            if not name.startswith(partial):
                break
            if name.endswith("/"):
                if self._walk(folder / name[:-1], rel + name, "", start_after, limit, out):
                    return True
            else:
                out.append(rel + name)
                if limit is not None and len(out) >= limit:
                    return True
        return False
