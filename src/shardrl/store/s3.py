"""`S3Store`: an S3-compatible bucket (MinIO, SeaweedFS, AWS) through the `minio` SDK.

`put_bytes` writes an object with a single PUT, so it is visible only when complete. `writer`
spools what is written to a temporary file and `put_file` reads a local file: either sends
an object of up to `STREAM_PART_SIZE` with one PUT and a larger one as a multipart upload of
parts of that size, one part in memory at a time, visible only once the upload is completed.
Transient failures (refused or reset connections, timeouts, 5xx, SlowDown) are retried under
a `RetryPolicy`; permanent ones (missing bucket, rejected credentials) fail at once with a
message naming the endpoint and the bucket. Credentials never appear in messages or repr.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import MAX_PART_SIZE, MIN_PART_SIZE, check_bucket_name

from shardrl.store.base import (
    NotFound,
    PermanentStoreError,
    Retrier,
    RetryPolicy,
    Store,
    StoreError,
    StoreURIError,
    check_key,
    check_limit,
    check_prefix,
    check_range,
)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "OperationAborted",
     "ConditionalRequestConflict"}  # the last: another conditional write to the key was under way
)
_CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
     "ExpiredToken", "AllAccessDisabled"}
)
STREAM_PART_SIZE = 64 << 20
"""Bytes per part of a multipart upload from a file (`writer`, `put_file`)."""
READ_TIMEOUT_S = (1.0, 120.0)
"""Bounds of how long a request waits for the server's next bytes: a quarter of the retry
deadline within them. A stalled connection (a server paused or restarted behind a proxy)
then fails soon enough to be retried on a new one before the deadline, instead of holding
the stage for the whole deadline or more. Bytes that keep coming (a large object) never time
out; a server slower than this to start an answer is retried, and fails the call at the
deadline as an unreachable one would."""

_ENV_HINT = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or SHARDRL_AWS_ACCESS_KEY_ID/...)"
_CREATE_HINT = "create it (`shardrl run ... --create-bucket` does) or fix the store URI"


def is_transient(error: BaseException) -> bool:
    """Whether retrying the request that raised `error` may succeed."""
    if isinstance(error, S3Error):
        status = error.response.status if error.response is not None else 0
        return error.code in _TRANSIENT_CODES or status >= 500 or status == 429
    if isinstance(error, ServerError):
        return error.status_code >= 500 or error.status_code == 429
    if isinstance(error, InvalidResponseError):
        status = getattr(error, "_code", 0) or 0
        return status >= 500 or status == 429
    if isinstance(error, urllib3.exceptions.SSLError):
        return False  # a certificate problem does not fix itself
    return isinstance(error, urllib3.exceptions.HTTPError | OSError)


def _env(name: str) -> str | None:
    """`SHARDRL_<name>` if set, else `<name>`, else None."""
    return os.environ.get(f"SHARDRL_{name}") or os.environ.get(name) or None


class S3Store(Store):
    """Objects under `prefix` in `bucket` at `endpoint` (`host:port` or `http(s)://host:port`)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str = "https://s3.amazonaws.com",
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        secure: bool | None = None,
        region: str = "us-east-1",
        retry: RetryPolicy | None = None,
    ) -> None:
        self._settings = dict(bucket=bucket, prefix=prefix, endpoint=endpoint,
                              access_key=access_key, secret_key=secret_key,
                              session_token=session_token, secure=secure,
                              region=region, retry=retry)
        """What `reopened` builds a new client from (its credentials are the client's too)."""
        if not bucket:
            raise StoreURIError("S3Store needs a bucket name")
        try:
            check_bucket_name(bucket, strict=True)
        except ValueError as e:
            raise PermanentStoreError(f"invalid S3 bucket name {bucket!r}: {e}") from None
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        if parts.username or parts.password:  # never echoed: it would carry the secret
            raise PermanentStoreError(
                "the S3 endpoint URL holds credentials (user:password@): give the host alone "
                f"and the keys in the environment ({_ENV_HINT})")
        if not access_key or not secret_key:
            raise PermanentStoreError(
                f"no credentials for bucket {bucket!r} at {endpoint}: set {_ENV_HINT}"
            )
        if parts.scheme not in ("", "http", "https") or not parts.netloc:
            raise StoreURIError(f"S3 endpoint must be host[:port] or http(s)://host[:port], got {endpoint!r}")
        if parts.scheme and secure is not None and secure != (parts.scheme == "https"):
            raise ValueError(f"secure={secure} contradicts the scheme of endpoint {endpoint!r}")
        secure = parts.scheme != "http" if secure is None else secure
        self.bucket = bucket
        self.prefix = check_prefix(prefix.strip("/") + "/") if prefix.strip("/") else ""
        self.endpoint = f"{'https' if secure else 'http'}://{parts.netloc}"
        self.retry = retry or RetryPolicy()
        low, high = READ_TIMEOUT_S
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5.0,
                                    read=min(high, max(low, self.retry.deadline_s / 4))),
            maxsize=16,
            retries=False,  # retries are ours, under self.retry
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        )
        self._client = Minio(
            parts.netloc, access_key=access_key, secret_key=secret_key,
            session_token=session_token,
            secure=secure, region=region, http_client=http,
        )
        self._retrier = Retrier(self.retry, f"{self.endpoint} bucket {bucket!r}", is_transient)
        self._bucket_checked = False
        self._bucket_lock = threading.Lock()

    @classmethod
    def from_uri(cls, uri: str, retry: RetryPolicy | None = None) -> S3Store:
        """Open `s3://bucket/prefix`; endpoint, region and credentials come from the environment.

        Reads `S3_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
        `AWS_SESSION_TOKEN` (temporary credentials; not renewed when they expire) and
        `AWS_REGION`/`AWS_DEFAULT_REGION`; a `SHARDRL_`-prefixed variable wins over the plain one.
        """
        parts = urlsplit(uri)
        if parts.scheme != "s3" or not parts.netloc:
            raise StoreURIError(f"expected s3://bucket/prefix, got {uri!r}")
        return cls(
            bucket=parts.netloc,
            prefix=parts.path,
            endpoint=_env("S3_ENDPOINT_URL") or "https://s3.amazonaws.com",
            access_key=_env("AWS_ACCESS_KEY_ID"),
            secret_key=_env("AWS_SECRET_ACCESS_KEY"),
            session_token=_env("AWS_SESSION_TOKEN"),
            region=_env("AWS_REGION") or _env("AWS_DEFAULT_REGION") or "us-east-1",
            retry=retry,
        )

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def reopened(self) -> S3Store:
        """A new client with its own connection pool, on the same bucket and settings."""
        return S3Store(**self._settings)

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"

    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._single_put(key, data)
        self._call("put", key, lambda: self._put_whole(name, data))

    def _single_put(self, key: str, data: bytes) -> str:
        """The object name of `key`, checked, for `data` sent in one PUT."""
        name = self.prefix + check_key(key)
        if len(data) > MAX_PART_SIZE:
            raise StoreError(f"{key!r} is {len(data)} bytes: a single PUT takes at most 5 GiB")
        return name

    def _put_whole(self, name: str, data: bytes) -> None:
        # A part size of at least the object's length makes the SDK send one PUT.
        self._client.put_object(self.bucket, name, io.BytesIO(data), len(data),
                                part_size=max(len(data), MIN_PART_SIZE))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """A conditional PUT (`If-None-Match: *`): S3, MinIO and SeaweedFS refuse it (412)
        when the object exists, so of two writers at once exactly one creates it. A server that
        answers NotImplemented gets a plain PUT; one that ignores the header overwrites, as
        looking then writing would (the look first leaves that to writers racing). A retry
        after a lost response reads the first attempt's object as there already: False."""
        if self.exists(key):
            return False
        name = self._single_put(key, data)
        headers = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}

        def create() -> bool:
            try:
                # the SDK's PUT with headers of our own (its public put_object sends only
                # metadata); the SDK is pinned in pyproject.toml
                self._client._put_object(self.bucket, name, data, headers=headers)
            except S3Error as e:
                if e.code == "PreconditionFailed":
                    return False
                if e.code != "NotImplemented":
                    raise
                self._put_whole(name, data)
            return True

        return self._call("create", key, create)

    @contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        """A temporary file (in the system's temp folder) that is uploaded when the block ends
        without an error, then removed; the object never exists in memory whole."""
        check_key(key)
        with tempfile.TemporaryFile(prefix="shardrl-put-") as spool:
            try:
                yield spool
                spool.flush()
            except OSError as e:
                raise StoreError(f"cannot spool {key!r} for {self.uri}: {e}") from e
            self._put_file(key, spool, os.fstat(spool.fileno()).st_size)

    def put_file(self, key: str, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._put_file(key, f, os.fstat(f.fileno()).st_size)

    def _put_file(self, key: str, f: IO[bytes], size: int) -> None:
        """Upload the `size` bytes of the open file `f` (read from its start at each attempt)."""
        name = self.prefix + check_key(key)
        part_size = max(size, MIN_PART_SIZE) if size <= STREAM_PART_SIZE else STREAM_PART_SIZE

        def put() -> None:
            f.seek(0)
            # one part read at a time: parallel uploads would queue every part read ahead
            self._client.put_object(self.bucket, name, f, size, part_size=part_size,
                                    num_parallel_uploads=1)

        self._call("put", key, put)

    def get_bytes(self, key: str) -> bytes:
        return self._get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        return self._get(key, offset, length)

    def _get(self, key: str, offset: int = 0, length: int = 0) -> bytes:
        """The object's bytes from `offset`, `length` of them (0: to its end)."""
        name = self.prefix + check_key(key)

        def get() -> bytes:
            try:
                response = self._client.get_object(self.bucket, name, offset=offset,
                                                   length=length)
            except S3Error as e:
                if e.code == "InvalidRange" and length:  # a range from past the end
                    return b""
                raise
            try:
                data = response.read()
            finally:
                response.close()
                response.release_conn()
            # a server (or a proxy) that ignores the range answers 200 with the whole
            # object, which is the range asked for only when that starts at 0 and holds it
            if length and response.status != 206 and (offset or len(data) > length):
                raise PermanentStoreError(f"get {key!r} in {self.uri} at {self.endpoint}: the "
                                          f"server ignored the byte range asked for")
            return data

        return self._call("get", key, get)

    def exists(self, key: str) -> bool:
        name = self.prefix + check_key(key)
        try:
            self._call("stat", key, lambda: self._client.stat_object(self.bucket, name))
        except NotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        name = self.prefix + check_key(key)
        self._call("delete", key, lambda: self._client.remove_object(self.bucket, name))

    def list(self, prefix: str = "", start_after: str | None = None,
             limit: int | None = None) -> list[str]:
        check_prefix(prefix)
        check_limit(limit)
        after = self.prefix + start_after if start_after is not None else None

        def scan() -> list[str]:
            # The SDK's private lister is the one that takes max-keys (the public one always
            # asks for pages of 1000); minio is pinned, so its signature is too.
            objects = self._client._list_objects(
                self.bucket, prefix=self.prefix + prefix, start_after=after,
                max_keys=min(limit, 1000) if limit is not None else None, encoding_type="url",
            )
            names = []
            for o in objects:
                if o.is_dir or (after is not None and o.object_name <= after):
                    continue  # a server that ignores start-after stays correct
                names.append(o.object_name)
                if limit is not None and len(names) >= limit:
                    break  # no further page is requested
            return names

        names = self._call("list", prefix, scan)
        cut = len(self.prefix)
        return sorted(n[cut:] for n in names)

    def _call(self, what: str, key: str, op: Callable[[], T]) -> T:
        """Run `op` under the retry policy and turn SDK errors into store errors."""
        self._check_bucket()
        try:
            return self._retrier.call(f"{what} {key!r}", op)
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchObject"):
                raise NotFound(f"no object {key!r} in {self.uri} at {self.endpoint}") from e
            raise self._permanent(e, f"{what} {key!r}") from e
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as e:
            raise StoreError(
                f"{what} {key!r} in bucket {self.bucket!r} at {self.endpoint} failed: "
                f"{type(e).__name__}: {e}"
            ) from e

    def create_bucket(self) -> bool:
        """Create the bucket when it is missing; True when this call created it."""
        try:
            found = self._retrier.call(
                "check bucket", lambda: self._client.bucket_exists(self.bucket)
            )
            if not found:
                self._retrier.call("create bucket", lambda: self._client.make_bucket(self.bucket))
        except S3Error as e:
            if e.code != "BucketAlreadyOwnedByYou":  # created meanwhile, by us
                raise self._permanent(e, "create bucket") from e
            found = True
        self._bucket_checked = True
        return not found

    def _check_bucket(self) -> None:
        """Fail clearly and at once when the bucket is missing or the credentials are wrong."""
        if self._bucket_checked:
            return
        with self._bucket_lock:
            if self._bucket_checked:
                return
            try:
                found = self._retrier.call(
                    "check bucket", lambda: self._client.bucket_exists(self.bucket)
                )
            except S3Error as e:
                raise self._permanent(e, "check bucket") from e
            if not found:
                raise PermanentStoreError(f"{self._where()} does not exist: {_CREATE_HINT}")
            self._bucket_checked = True

    def _where(self) -> str:
        return f"bucket {self.bucket!r} at endpoint {self.endpoint}"

    def _permanent(self, error: S3Error, what: str) -> StoreError:
        """The store error for an S3 error response that retrying cannot fix."""
        where = self._where()
        if error.code == "NoSuchBucket":
            return PermanentStoreError(f"{where} does not exist: {_CREATE_HINT}")
        if error.code in _CREDENTIAL_CODES:
            return PermanentStoreError(
                f"{what}: {where} rejected the request ({error.code}: {error.message}); "
                f"check the credentials in {_ENV_HINT} and the bucket's access policy"
            )
        return StoreError(f"{what} in {where} failed ({error.code}: {error.message})")
