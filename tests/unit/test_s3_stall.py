"""An S3 server that accepts a connection and never answers: the request times out within
the retry deadline and is retried on a new connection, and the store then fails with its
clear message, instead of holding the stage for the socket's full read timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from shardrl.store import RetryPolicy, StoreUnavailable
from shardrl.store.s3 import READ_TIMEOUT_S, S3Store


@pytest.fixture
def silent_server():
    """A loopback port that accepts connections, reads nothing and answers nothing; yields
    (port, the connections accepted so far)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], held
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_stalled_request_is_retried_and_fails_within_the_deadline(silent_server):
    port, held = silent_server
    deadline = 4.0
    store = S3Store(bucket="stalled", endpoint=f"http://127.0.0.1:{port}", access_key="k",
                    secret_key="s", region="us-east-1",
                    retry=RetryPolicy(max_attempts=100, base_delay_s=0.05, max_delay_s=0.1,
                                      deadline_s=deadline))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="failed after .* Read timed out") as failed:
        store.get_bytes("x.json")
    elapsed = time.monotonic() - started
    # a read waits a quarter of the deadline here (1 s): it used to wait 120 s
    assert READ_TIMEOUT_S[0] == 1.0 and deadline / 4 == 1.0
    # the deadline counts from the first failure, the first stall's end (1 s in)
    assert deadline + 1 <= elapsed < deadline + 4, elapsed
    attempts = int(str(failed.value).split("after ")[1].split(" attempts")[0])
    assert attempts >= 3 and len(held) >= 3  # each retry on a new connection
    assert "read timeout=1.0" in str(failed.value)
