"""Retry policy, outage logging, key checks, store URIs and S3 error classification."""

import logging

import pytest
import urllib3
from minio.error import S3Error, ServerError

from shardrl.store import LocalStore, PermanentStoreError, RetryPolicy, StoreUnavailable, open_store
from shardrl.store.base import Retrier, check_key
from shardrl.store.s3 import S3Store, is_transient


class NoJitter:
    """A jitter draw of 0: every delay is half its cap."""

    def random(self) -> float:
        return 0.0


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _retrier(policy: RetryPolicy, fake: FakeTime) -> Retrier:
    return Retrier(
        policy, "test-store", lambda e: isinstance(e, ConnectionError),
        clock=fake.clock, sleep=fake.sleep, rng=NoJitter(),
    )


def _failing(times: int):
    calls = {"n": 0}

    def op() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise ConnectionError("refused")
        return "ok"

    return op, calls


def test_delay_is_bounded_exponential_with_jitter():
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=4.0)
    # cap = min(4, 1 * 2**(attempt-1)) = 1, 2, 4, 4; the delay lies in [cap/2, cap).
    assert [policy.delay(a, 0.0) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 2.0]
    assert policy.delay(2, 0.5) == 1.5
    with pytest.raises(ValueError):
        RetryPolicy(base_delay_s=5.0, max_delay_s=1.0)


def test_transient_failures_are_retried_and_the_outage_logged_once(caplog):
    fake = FakeTime()
    op, calls = _failing(4)
    with caplog.at_level(logging.WARNING, logger="shardrl.store"):
        assert _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0), fake).call("put", op) == "ok"
    assert calls["n"] == 5
    assert fake.sleeps == [0.5, 1.0, 2.0, 2.0]
    messages = [r.getMessage() for r in caplog.records]
    # The outage starts at t=0 (first failure) and ends at t=0.5+1+2+2=5.5 (success).
    assert len(messages) == 2
    assert messages[0].startswith("object store test-store unavailable (ConnectionError: refused)")
    assert messages[1] == "object store test-store available again after 5.5 s"


def test_a_reported_outage_is_told_once_by_the_process_that_logs(caplog):
    """A commit writer's store reports its outage instead of logging it; the learner's store
    logs what is relayed to it once, merged with an outage its own calls meet."""
    fake = FakeTime()
    child = _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0), fake)
    parent = _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0, deadline_s=60), fake)
    sent: list[tuple[str, str | None]] = []

    def report(event: str, cause: str | None) -> None:
        sent.append((event, cause))
        parent.relay(event, cause)

    child.report = report
    with caplog.at_level(logging.WARNING, logger="shardrl.store"):
        op, _ = _failing(2)
        assert child.call("put", op) == "ok"  # fails at t=0 and t=0.5, succeeds at t=1.5
        # the parent's own calls meet the next outage too: one start, one end in its log
        fake.now += 100.0
        parent.relay("start", "ConnectionError: refused")
        op, _ = _failing(1)
        assert parent.call("get", op) == "ok"  # its own failure continues the outage
        parent.relay("end", None)  # the child's end comes after the parent's: no line
    assert sent == [("start", "ConnectionError: refused"), ("end", None)]
    assert [r.getMessage() for r in caplog.records] == [
        "object store test-store unavailable (ConnectionError: refused); retrying for up to 60 s or 10 attempts per operation",
        "object store test-store available again after 1.5 s",
        "object store test-store unavailable (ConnectionError: refused); retrying for up to 60 s or 10 attempts per operation",
        "object store test-store available again after 0.5 s"]
    with pytest.raises(ValueError, match="unknown outage event"):
        parent.relay("middle", None)


def test_retries_stop_at_the_deadline():
    fake = FakeTime()
    op, calls = _failing(100)
    retrier = _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0, deadline_s=3.0), fake)
    # Attempt 1 fails at t=0, sleeps 0.5; attempt 2 at t=0.5 sleeps 1.0; attempt 3 at
    # t=1.5 would sleep 2.0 and end at 3.5 > 3: give up after 3 attempts over 1.5 s.
    with pytest.raises(StoreUnavailable, match=r"put failed after 3 attempts over 1\.5 s") as info:
        retrier.call("put", op)
    assert "Check that the object store is running" in str(info.value)
    assert calls["n"] == 3 and fake.sleeps == [0.5, 1.0]


def test_the_deadline_counts_from_the_first_failure_not_from_a_long_transfer():
    """A checkpoint's upload that ran 150 s before its connection broke is retried under a
    120 s deadline: the transfer was not outage time."""
    fake = FakeTime()
    calls = {"n": 0}

    def upload() -> str:
        calls["n"] += 1
        fake.now += 150.0  # the transfer, until the connection resets (or, then, succeeds)
        if calls["n"] == 1:
            raise ConnectionError("reset by peer")
        return "ok"

    retrier = _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0, deadline_s=120.0), fake)
    assert retrier.call("put", upload) == "ok"
    assert calls["n"] == 2 and fake.sleeps == [0.5]

    # failing for longer than the deadline since the first failure still gives up
    fake, calls["n"] = FakeTime(), 0

    def slow_failure() -> None:
        fake.now += 100.0
        raise ConnectionError("reset by peer")

    retrier = _retrier(RetryPolicy(base_delay_s=1.0, max_delay_s=4.0, deadline_s=120.0), fake)
    # failures at t=100 (the clock starts), 200.5 (100.5 s in: a retry still fits) and 301.5
    with pytest.raises(StoreUnavailable, match=r"after 3 attempts over 201\.5 s"):
        retrier.call("put", slow_failure)


def test_retries_stop_after_max_attempts_and_permanent_errors_are_not_retried():
    fake = FakeTime()
    op, calls = _failing(100)
    with pytest.raises(StoreUnavailable):
        _retrier(RetryPolicy(max_attempts=2), fake).call("get", op)
    assert calls["n"] == 2 and len(fake.sleeps) == 1

    def permanent() -> None:
        raise KeyError("no")

    with pytest.raises(KeyError):
        _retrier(RetryPolicy(), fake).call("get", permanent)
    assert len(fake.sleeps) == 1


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "..", ".hidden", "a\\b", "a\nb"])
def test_invalid_keys(key):
    with pytest.raises(ValueError):
        check_key(key)


def test_open_store_dispatches_on_the_uri(tmp_path, monkeypatch):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert open_store(tmp_path.as_uri()).uri == tmp_path.resolve().as_uri()
    with pytest.raises(ValueError, match="unsupported store URI scheme 'gs'"):
        open_store("gs://bucket/x")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SHARDRL_AWS_ACCESS_KEY_ID",
                 "SHARDRL_AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL", "SHARDRL_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PermanentStoreError, match="no credentials for bucket 'bkt'"):
        open_store("s3://bkt/p")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "plain-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://plain:1")
    monkeypatch.setenv("SHARDRL_S3_ENDPOINT_URL", "http://preferred:9000")
    store = open_store("s3://bucket/some/prefix/")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint) == (
        "bucket", "some/prefix/", "http://preferred:9000"
    )
    assert store.uri == "s3://bucket/some/prefix"
    assert "s3cr3t" not in repr(store) and "plain-id" not in repr(store)


def _s3_error(code: str, status: int) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=status), code, "msg", "/b/k", None, None)


@pytest.mark.parametrize(("error", "transient"), [
    (_s3_error("SlowDown", 503), True),
    (_s3_error("InternalError", 500), True),
    (_s3_error("WeirdServerThing", 502), True),
    (_s3_error("NoSuchBucket", 404), False),
    (_s3_error("AccessDenied", 403), False),
    (_s3_error("SignatureDoesNotMatch", 403), False),
    (ServerError("bad gateway", 502), True),
    (ConnectionRefusedError(111, "refused"), True),
    (TimeoutError("timed out"), True),
    (urllib3.exceptions.ProtocolError("reset"), True),
    (urllib3.exceptions.SSLError("bad certificate"), False),
    (ValueError("bug"), False),
])
def test_s3_error_classification(error, transient):
    assert is_transient(error) is transient
