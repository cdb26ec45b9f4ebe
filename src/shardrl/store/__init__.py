"""Object store: the contract between stages (see the design's object-store protocol).

`open_store(uri)` gives a `Store` (a local folder or an S3 bucket); `RunKeys` names
every object of a run; `write_shard`/`read_shard` move Parquet tables checked against
the boundary schemas of `shardrl.store.schemas`.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from shardrl.redact import has_userinfo
from shardrl.store.base import (
    NotFound,
    PermanentStoreError,
    RetryPolicy,
    Store,
    StoreError,
    StoreUnavailable,
    StoreURIError,
)
from shardrl.store.keys import RunKeys, ShardKey, parse_shard_key
from shardrl.store.local import LocalStore
from shardrl.store.shards import (
    CorruptShard,
    SchemaError,
    ShardError,
    list_column_to_padded,
    padded_to_list_array,
    quarantine,
    read_columns,
    read_or_quarantine,
    read_shard,
    shards_by_name,
    write_shard,
)


def open_store(uri: str, retry: RetryPolicy | None = None) -> Store:
    """`s3://bucket/prefix` -> S3Store (credentials from the environment);
    `file:///abs/path` or a plain path -> LocalStore. `retry` applies to S3 only."""
    if has_userinfo(uri):  # before anything quotes it
        raise StoreURIError(
            "the store URI holds credentials (user:password@): give s3://bucket/prefix alone "
            "and the credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    scheme = urlsplit(uri).scheme
    if scheme == "s3":
        from shardrl.store.s3 import S3Store  # the minio SDK only when needed

        return S3Store.from_uri(uri, retry=retry)
    if scheme == "file":
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise StoreURIError(f"file URI must name a local path (file:///abs/path), got {uri!r}")
        return LocalStore(Path(unquote(parts.path)))
    if scheme and len(scheme) > 1:  # one letter would be a Windows drive
        raise StoreURIError(f"unsupported store URI scheme {scheme!r} in {uri!r}: use s3:// or file://")
    return LocalStore(Path(uri))


__all__ = [
    "CorruptShard", "LocalStore", "NotFound", "PermanentStoreError", "RetryPolicy", "RunKeys",
    "SchemaError", "ShardError", "ShardKey", "Store", "StoreError", "StoreURIError",
    "StoreUnavailable",
    "list_column_to_padded", "open_store", "padded_to_list_array", "parse_shard_key",
    "quarantine", "read_columns", "read_or_quarantine", "read_shard", "shards_by_name",
    "write_shard",
]
