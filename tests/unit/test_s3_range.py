"""A server that ignores a byte range answers 200 with the whole object: the S3 store must
not hand that back as the range asked for (a resume reads the optimizer state by ranges)."""

from __future__ import annotations

import http.server
import threading

import pytest

from shardrl.store import PermanentStoreError, RetryPolicy
from shardrl.store.s3 import S3Store

OBJECT = bytes(range(200))


class _IgnoresRanges(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:  # the bucket exists
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.server.ranges.append(self.headers.get("Range"))
        self.send_response(200)
        self.send_header("Content-Length", str(len(OBJECT)))
        self.end_headers()
        self.wfile.write(OBJECT)


@pytest.fixture
def store():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _IgnoresRanges)
    server.ranges = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield S3Store(bucket="ranges", endpoint=f"http://127.0.0.1:{server.server_address[1]}",
                  access_key="k", secret_key="s", region="us-east-1",
                  retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, deadline_s=2)), server
    server.shutdown()
    server.server_close()


def test_a_range_the_server_ignored_is_refused_not_returned(store):
    s3, server = store
    # from an offset: the whole object used to come back as bytes 50-299 (it is shorter than
    # the 250 bytes asked for, so the length check passed)
    with pytest.raises(PermanentStoreError, match="ignored the byte range"):
        s3.get_range("obj", 50, 250)
    assert server.ranges[-1] == "bytes=50-299"
    # longer than the range asked for
    with pytest.raises(PermanentStoreError, match="ignored the byte range"):
        s3.get_range("obj", 0, 10)
    # from 0 and holding the whole range: the whole object is the range asked for
    assert s3.get_range("obj", 0, 500) == OBJECT
    assert s3.get_bytes("obj") == OBJECT
