"""The `Store` interface, its errors, key validation and the retry policy.

A store holds immutable objects under string keys relative to its root
(`runs/r1/rollouts/v000012/w00-000034.parquet`). An object becomes visible only when
complete, so a reader either sees the whole object or nothing.
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

log = logging.getLogger("shardrl.store")

T = TypeVar("T")


class StoreError(Exception):
    """Any failure of a store operation."""


class NotFound(StoreError):
    """The key does not exist."""


class PermanentStoreError(StoreError):
    """Retrying cannot help: bad credentials, missing bucket, access denied."""


class StoreURIError(PermanentStoreError, ValueError):
    """A store URI or endpoint that names no store this project can open."""


class StoreUnavailable(StoreError):
    """Transient failures went on past the retry policy's attempts or deadline."""


def check_key(key: str) -> str:
    """Return `key` if it is a valid relative object key, else raise ValueError.

    A key is `/`-separated, relative, with non-empty segments that do not start with a
    dot (this keeps `..` out and reserves dot-names for the local store's temp files).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if "\\" in key or any(ord(c) < 32 for c in key):
        raise ValueError(f"object key {key!r} contains a backslash or a control character")
    for segment in key.split("/"):
        if not segment or segment.startswith("."):
            raise ValueError(
                f"object key {key!r} must be relative, without empty segments or segments "
                "starting with '.'"
            )
    return key


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it can start a valid key (`''`, `runs/`, `runs/r1/roll`)."""
    if prefix:
        check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def check_limit(limit: int | None) -> int | None:
    """Return `limit` if it is None or a positive integer, else raise ValueError."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"list limit must be None or an integer >= 1, got {limit!r}")
    return limit


def check_range(offset: int, length: int) -> None:
    """ValueError unless `offset >= 0` and `length >= 1` are integers."""
    for name, value, least in (("offset", offset, 0), ("length", length, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"range {name} must be an integer >= {least}, got {value!r}")


class Store(ABC):
    """An object store rooted at `uri`; keys are relative to that root."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """Where the root is: `file:///abs/dir` or `s3://bucket/prefix`."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write `data` at `key`; it becomes visible to readers only when complete."""

    @contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        """A binary file to write the object at `key` into, piece by piece: the object
        appears, complete, when the block ends without an error, and nothing appears when it
        raises. This default gathers the bytes in memory and puts them at the end; the local
        and S3 stores override it to keep at most a buffer's worth of them in memory."""
        check_key(key)
        buffer = io.BytesIO()
        yield buffer
        self.put_bytes(key, buffer.getvalue())

    def put_file(self, key: str, path: str | Path) -> None:
        """Write the content of the local file `path` at `key`, as `put_bytes` would, without
        reading it into memory whole (in the stores that override `writer` or this)."""
        with open(path, "rb") as src, self.writer(key) as out:
            shutil.copyfileobj(src, out, 1 << 20)

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read the whole object at `key`; raise NotFound when it does not exist."""

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes `offset` to `offset + length` of the object at `key`: fewer at its end, none
        from past it; NotFound when it does not exist. This default reads the whole object;
        the local and S3 stores read only the range."""
        check_range(offset, length)
        return self.get_bytes(key)[offset:offset + length]

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at `key`."""

    @abstractmethod
    def list(self, prefix: str = "", start_after: str | None = None,
             limit: int | None = None) -> list[str]:
        """Keys starting with `prefix`, sorted, all greater than `start_after` if given, at
        most the first `limit` of them if given (ValueError unless `limit >= 1`).

        Pass the last key of the previous listing as `start_after` to resume a scan
        without listing everything again; a small `limit` makes a hop to the next key
        after a point cheap whatever follows it. Keys sort by their bytes, where SeaweedFS
        differs in two cases that run layouts avoid: it lists a folder before a sibling whose
        name extends the folder's name by a character below '/' (`a/b/` before `a/b.json`),
        and skips a whole folder named by `start_after` (pass keys seen before).
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object at `key`; deleting a missing key is not an error."""

    _retrier: Retrier | None = None
    """What retries this store's operations and tells of its outages; None: it never retries
    (the folder store)."""

    def report_outages(self, report: Callable[[str, str | None], None] | None) -> None:
        """Send the start and end of each outage this store rides out to `report(event,
        cause)` instead of logging them (`Retrier.report`); None logs them again. A store
        that never retries has no outages to report."""
        if self._retrier is not None:
            self._retrier.report = report

    def relay_outage(self, event: str, cause: str | None) -> None:
        """An outage event that another process's `report_outages` sent, logged as this
        store's own (`Retrier.relay`); nothing for a store that never retries."""
        if self._retrier is not None:
            self._retrier.relay(event, cause)

    def reopened(self) -> Store:
        """The same store for a forked child process, sharing no connection with this one
        (two processes writing into one socket garble both); a store that holds no
        connections is its own."""
        return self

    def watch(self, prefix: str, depth: int = 1):
        """A waiter that wakes when objects may have been committed under `prefix` (folder
        `depth` levels deep): `watch(...).wait(timeout)` replaces a fixed sleep. This default
        polls adaptively (`shardrl.store.watch.PollWatch`); stores that can be told about
        commits override it."""
        from shardrl.store.watch import PollWatch

        check_prefix(prefix)
        return PollWatch()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write `data` at `key` unless an object is there; whether it was written. This
        default looks, then writes: two writers at once may both write (the later wins).
        Stores that can create an object only if it is absent override it."""
        if self.exists(key):
            return False
        self.put_bytes(key, data)
        return True

    def put_json(self, key: str, obj: Any) -> None:
        """Write `obj` as strict JSON (NaN and infinities are rejected with ValueError)."""
        self.put_bytes(key, json_bytes(obj))

    def get_json(self, key: str) -> Any:
        """Read a JSON object written by `put_json`."""
        data = self.get_bytes(key)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{self.uri} key {key!r} is not valid JSON: {e}") from e

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def json_bytes(obj: Any) -> bytes:
    """`obj` as the strict JSON `Store.put_json` writes."""
    return json.dumps(obj, indent=2, allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter for transient store failures."""

    max_attempts: int = 10
    """Attempts in total, the first included."""
    base_delay_s: float = 0.2
    """Delay before the second attempt (before jitter); doubles each attempt."""
    max_delay_s: float = 5.0
    """Upper bound of one delay."""
    deadline_s: float = 60.0
    """No retry starts later than this many seconds after the first attempt."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.base_delay_s <= self.max_delay_s:
            raise ValueError(
                f"need 0 < base_delay_s <= max_delay_s, got {self.base_delay_s}, {self.max_delay_s}"
            )
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    def delay(self, attempt: int, u: float) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based).

        `u` in [0, 1) is the jitter draw: the delay lies in [cap/2, cap) where
        `cap = min(max_delay_s, base_delay_s * 2 ** (attempt - 1))`.
        """
        cap = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return cap * (0.5 + 0.5 * u)


class Retrier:
    """Runs operations under a RetryPolicy and logs an outage once when it starts and ends.

    `is_transient(exc)` decides which exceptions are retried; others propagate at once.
    One Retrier is shared by all operations of a store, so concurrent calls report one
    outage, not one per call. Failures within `settle_s` of a recovery (a server that
    answers errors for a while as it comes back) continue the outage already logged and
    add no lines.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        target: str,
        is_transient: Callable[[BaseException], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        settle_s: float = 30.0,
    ) -> None:
        self.policy = policy
        self.settle_s = settle_s
        self.target = target
        self._is_transient = is_transient
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._outage_since: float | None = None
        self._recovered_at: float | None = None
        self._quiet = False  # the current outage is a flap of the one logged before
        self.report: Callable[[str, str | None], None] | None = None
        """Where the start and end of an outage go instead of this process's log:
        `report("start", "ErrorType: message")` and `report("end", None)` (see `relay`)."""

    def call(self, what: str, op: Callable[[], T]) -> T:
        """Return `op()`, retrying transient failures; `what` names the operation in errors.

        The deadline counts from the first failure: the time a long transfer ran before
        the connection broke is not outage time, so a large checkpoint's upload cut late
        gets a retry. The retries' own transfers count: an upload longer than the deadline
        gets that one retry."""
        start: float | None = None
        attempt = 0
        while True:
            attempt += 1
            try:
                result = op()
            except Exception as e:
                if not self._is_transient(e):
                    raise
                self.outage_seen(f"{type(e).__name__}: {e}")
                if start is None:
                    start = self._clock()
                elapsed = self._clock() - start
                with self._lock:
                    delay = self.policy.delay(attempt, self._rng.random())
                if attempt >= self.policy.max_attempts or elapsed + delay > self.policy.deadline_s:
                    raise StoreUnavailable(
                        f"{self.target}: {what} failed after {attempt} attempts over "
                        f"{elapsed:.1f} s ({type(e).__name__}: {e}). Check that the object "
                        "store is running and reachable from here, or raise the retry "
                        "deadline (store.retry.deadline_s) to ride out longer outages."
                    ) from e
                self._sleep(delay)
            else:
                self.outage_over()
                return result

    def outage_seen(self, cause: str) -> None:
        """An outage starts, by a failed call of this store's or one `cause` names that
        another process saw on the same store (`relay`); logged (or reported) once, unless
        one is already under way or it is a flap of the last."""
        with self._lock:
            if self._outage_since is not None:
                return
            self._outage_since = now = self._clock()
            self._quiet = (self._recovered_at is not None
                           and now - self._recovered_at < self.settle_s)
            if self._quiet:
                return
        if self.report is not None:
            self.report("start", cause)
            return
        log.warning("object store %s unavailable (%s); retrying for up to %.0f s or %d "
                    "attempts per operation", self.target, cause, self.policy.deadline_s,
                    self.policy.max_attempts)

    def outage_over(self) -> None:
        """The outage under way (if any) is over: a call succeeded, here or in the process
        that reported its start."""
        with self._lock:
            if self._outage_since is None:
                return
            self._recovered_at = self._clock()
            duration = self._recovered_at - self._outage_since
            self._outage_since = None
            if self._quiet:
                return
        if self.report is not None:
            self.report("end", None)
            return
        log.warning("object store %s available again after %.1f s", self.target, duration)

    def relay(self, event: str, cause: str | None) -> None:
        """Take an outage event that `report` sent from another process (a learner's commit
        writer, whose store calls are the learner's) as this store's own: the process that
        owns the log tells of one outage once, whichever of its processes met it."""
        if event == "start":
            self.outage_seen(cause or "unknown error")
        elif event == "end":
            self.outage_over()
        else:
            raise ValueError(f"unknown outage event {event!r}")
