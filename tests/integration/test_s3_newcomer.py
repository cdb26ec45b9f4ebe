"""The S3 path as a new user meets it: a bucket that does not exist yet, `--create-bucket`,
and `make s3` (a local SeaweedFS with generated credentials)."""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from e2e.conftest import TINY, run_cli
from seaweed import free_ports
from shardrl.store import PermanentStoreError
from shardrl.store.s3 import S3Store


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    for name in ("SHARDRL_AWS_ACCESS_KEY_ID", "SHARDRL_AWS_SECRET_ACCESS_KEY",
                 "SHARDRL_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("S3_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    return seaweed


def _config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY + f"tracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    return path


def test_a_missing_bucket_is_one_line_and_a_nonzero_exit(s3_env, tmp_path):
    bucket = "newbucket-" + secrets.token_hex(4)
    res = run_cli(["run", str(_config(tmp_path)), "--store", f"s3://{bucket}/exp1"], tmp_path,
                  timeout=120)
    assert res.returncode == 1
    assert "Traceback" not in res.stdout + res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert f"bucket '{bucket}'" in line and "does not exist" in line and s3_env.endpoint in line
    assert "--create-bucket" in line
    assert not s3_env.client().bucket_exists(bucket)  # nothing was created


def test_create_bucket_creates_it_once_and_rejects_invalid_names(s3_env):
    bucket = "created-" + secrets.token_hex(4)
    store = S3Store.from_uri(f"s3://{bucket}/p")
    assert store.create_bucket() is True
    assert S3Store.from_uri(f"s3://{bucket}/q").create_bucket() is False  # already there
    store.put_json("x.json", {"a": 1})
    assert store.get_json("x.json") == {"a": 1}
    with pytest.raises(PermanentStoreError, match="invalid S3 bucket name 'New_Bucket'"):
        S3Store.from_uri("s3://New_Bucket/p")


@pytest.mark.slow
def test_run_with_create_bucket_completes_on_a_fresh_bucket(s3_env, tmp_path):
    bucket = "fresh-" + secrets.token_hex(4)
    res = run_cli(["run", str(_config(tmp_path)), "--store", f"s3://{bucket}/exp1",
                   "--create-bucket", "--run-id", "fresh", "--no-progress",
                   "--set", "learner.total_steps=2", "--set", "eval.every=2"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"created bucket '{bucket}'" in res.stdout
    store = S3Store.from_uri(f"s3://{bucket}/exp1")
    assert store.exists("runs/fresh/DONE.json") and store.exists("runs/fresh/run.json")


def test_make_s3_serves_with_generated_credentials_only(tmp_path):
    """`make s3` runs `python -m shardrl.store.seaweedfs`: it prints the three variables, and
    the server accepts those credentials and nothing else; a restart keeps both."""
    (port,) = free_ports(1)
    folder = tmp_path / "s3"

    def start() -> tuple[subprocess.Popen, dict[str, str]]:
        proc = subprocess.Popen([sys.executable, "-m", "shardrl.store.seaweedfs", "--dir",
                                 str(folder), "--port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        env: dict[str, str] = {}
        deadline = time.monotonic() + 90
        while len(env) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if m := re.fullmatch(r"export (\w+)=(\S+)\n", line):
                env[m[1]] = m[2]
        assert set(env) == {"S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, env
        return proc, env

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

    proc, env = start()
    try:
        assert env["S3_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        assert (folder / "env").read_text() == "".join(f"export {k}={v}\n" for k, v in env.items())
        for name in ("env", "s3.json", "server.json"):
            assert (folder / name).stat().st_mode & 0o077 == 0, name  # owner only
        with pytest.raises(urllib.error.HTTPError) as anonymous:
            urllib.request.urlopen(urllib.request.Request(f"{env['S3_ENDPOINT_URL']}/anon",
                                                          method="PUT"), timeout=10)
        assert anonymous.value.code == 403
        store = S3Store("try", "p", env["S3_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"],
                        env["AWS_SECRET_ACCESS_KEY"])
        assert store.create_bucket()
        store.put_json("k.json", {"v": 1})
        wrong = S3Store("try", "p", env["S3_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], "x" * 40)
        with pytest.raises(PermanentStoreError, match="rejected"):
            wrong.get_json("k.json")
    finally:
        stop(proc)
    proc, again = start()
    try:
        assert again == env
        store = S3Store("try", "p", env["S3_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"],
                        env["AWS_SECRET_ACCESS_KEY"])
        assert store.get_json("k.json") == {"v": 1}
    finally:
        stop(proc)
