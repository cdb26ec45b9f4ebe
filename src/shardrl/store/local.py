"""`LocalStore`: a folder as object store (the embedded default on one machine).

A write goes to a temp file in the destination's folder, is fsynced, then renamed over
the key (`os.replace` is atomic on POSIX), so readers never see a partial object and
several processes can write distinct keys at once.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from shardrl.store.base import NotFound, Store, StoreError, check_key, check_prefix

_TMP_SUFFIX = ".tmp"


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
        path = self._path(key)
        # Temp names start with '.', which no key segment may, so list() never shows them.
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {key!r} in {self.uri}: {e}") from e

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
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

    def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        check_prefix(prefix)
        # Walk only the folder that holds every key with this prefix.
        base = prefix.rpartition("/")[0]
        top = self.root.joinpath(*base.split("/")) if base else self.root
        keys: list[str] = []
        self._walk(top, f"{base}/" if base else "", prefix, start_after, keys)
        keys.sort()
        return keys

    def _walk(
        self, folder: Path, rel: str, prefix: str, start_after: str | None, out: list[str]
    ) -> None:
        """Append to `out` the keys under `folder` (whose key prefix is `rel`) that match."""
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith("."):  # temp files of writes in progress
                continue
            key = rel + entry.name
            if entry.is_dir(follow_symlinks=False):
                sub = key + "/"
                # Skip folders whose keys cannot match the prefix or all sort before start_after.
                if not (sub.startswith(prefix) or prefix.startswith(sub)):
                    continue
                if start_after is not None and sub < start_after and not start_after.startswith(sub):
                    continue
                self._walk(Path(entry.path), sub, prefix, start_after, out)
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                out.append(key)
