"""`make pipeline-run` / `shardrl pipeline run` against a local stand-in of the KFP v2beta1 API.

The stand-in answers the endpoints kfp.Client calls with minimal valid JSON and records every
request, so the tests assert on what a real Kubeflow Pipelines API would have received.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from pipelines.cluster import DEFAULT_STORE, SERVICE_ACCOUNT
from pipelines.shardrl import config_text
from pipelines.submit import version_name
from shardrl.cli import main as cli_main
from shardrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
API = "/apis/v2beta1"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)

    def uploaded_file(self) -> bytes:
        """The file part of a multipart/form-data upload."""
        head = f"Content-Type: {self.headers['content-type']}\r\n\r\n".encode()
        message = BytesParser().parsebytes(head + self.body)
        return next(p.get_payload(decode=True) for p in message.walk() if p.get_filename())


@dataclass
class FakeKfp:
    """State of the stand-in: which pipeline/versions exist and how the run ends."""

    existing_pipeline: bool = False
    existing_version: str | None = None
    final_state: str = "SUCCEEDED"
    token: str | None = None
    """The only bearer token the API accepts (None: any, or none)."""
    failing_polls: int = 0
    """Polls of the run that fail with 503 before they answer."""
    login_page: bool = False
    """Every request gets an HTML page, as behind a login proxy."""
    lost_run_answers: int = 0
    """Runs created whose answer is lost: the connection closes without one."""
    runs: list[dict] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def answer(self, req: Request) -> tuple[int, dict | str] | None:
        """(status, JSON or HTML), or None: no answer, the connection closes."""
        route = (req.method, req.path)
        run = next((r for r in self.runs if req.path == f"{API}/runs/{r['run_id']}"), None)
        if self.login_page:
            return 200, "<html><body>Log in</body></html>"
        if self.token is not None and req.headers.get("authorization") != f"Bearer {self.token}":
            return 401, {"error": "Unauthenticated"}
        if req.method == "GET" and run is not None and self.failing_polls:
            self.failing_polls -= 1
            return 503, {"error": "unavailable"}
        if route == ("GET", f"{API}/healthz"):
            return 200, {"multi_user": False}
        if route == ("GET", f"{API}/pipelines"):
            found = [{"pipeline_id": "pl-1", "display_name": "shardrl"}]
            return 200, {"pipelines": found, "total_size": 1} if self.existing_pipeline else {}
        if route == ("POST", f"{API}/pipelines/upload"):
            return 200, {"pipeline_id": "pl-1", "display_name": req.query["name"][0]}
        if route == ("GET", f"{API}/pipelines/pl-1/versions"):
            if self.existing_pipeline and self.existing_version is None:
                return 200, {}
            name = self.existing_version or "shardrl"
            return 200, {"pipeline_versions": [
                {"pipeline_id": "pl-1", "pipeline_version_id": "pv-1", "display_name": name}]}
        if route == ("POST", f"{API}/pipelines/upload_version"):
            return 200, {"pipeline_id": "pl-1", "pipeline_version_id": "pv-2",
                         "display_name": req.query["name"][0]}
        if route == ("GET", f"{API}/experiments"):
            return 200, {}
        if route == ("POST", f"{API}/experiments"):
            return 200, {"experiment_id": "exp-1", "display_name": req.json()["display_name"]}
        if route == ("POST", f"{API}/runs"):
            body = req.json()
            self.runs.append({"run_id": f"run-{len(self.runs) + 1}", "state": "PENDING",
                              "display_name": body["display_name"],
                              "experiment_id": body["experiment_id"],
                              "pipeline_version_reference": body["pipeline_version_reference"],
                              "runtime_config": body["runtime_config"]})
            if self.lost_run_answers:
                self.lost_run_answers -= 1
                return None
            return 200, self.runs[-1]
        if route == ("GET", f"{API}/runs"):  # filtered by experiment and display name only
            (predicate,) = json.loads(req.query["filter"][0])["predicates"]
            assert predicate["key"] == "display_name" and predicate["operation"] == "EQUALS"
            found = [r for r in self.runs if r["experiment_id"] == req.query["experiment_id"][0]
                     and r["display_name"] == predicate["stringValue"]]
            return 200, {"runs": found[::-1][:1], "total_size": len(found)} if found else {}
        if req.method == "GET" and run is not None:
            return 200, {**run, "state": self.final_state}
        return 404, {"error": f"no route {req.method} {req.path}"}

    def paths(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def one(self, method: str, path: str) -> Request:
        hits = [r for r in self.requests if (r.method, r.path) == (method, path)]
        assert len(hits) == 1, f"{method} {path}: {len(hits)} requests in {self.paths()}"
        return hits[0]


def _handler(state: FakeKfp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("content-length") or 0)
            req = Request(self.command, url.path, parse_qs(url.query),
                          {k.lower(): v for k, v in self.headers.items()},
                          self.rfile.read(length))
            state.requests.append(req)
            answer = state.answer(req)
            if answer is None:  # the request was carried out and its answer lost
                self.close_connection = True
                return
            status, payload = answer
            html = isinstance(payload, str)
            body = payload.encode() if html else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "text/html" if html else "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _serve

        def log_message(self, *args: object) -> None:
            return None

    return Handler


@pytest.fixture
def kfp_api() -> Iterator[tuple[str, FakeKfp]]:
    state = FakeKfp()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def version_name_of(upload: Request) -> str:
    """The version name the uploaded package's bytes give."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        package = Path(folder) / "p.yaml"
        package.write_bytes(upload.uploaded_file())
        return version_name(package)


def test_make_pipeline_run_uploads_and_starts_a_run(kfp_api, tmp_path):
    host, state = kfp_api
    env = {**os.environ, "KFP_HOST": host, "KFP_TOKEN": "t0ken", "HOME": str(tmp_path)}
    for name in ("KFP_NAMESPACE", "KFP_SERVICE_ACCOUNT", "KF_PIPELINES_UI_ENDPOINT"):
        env.pop(name, None)
    # -o: treat the venv stamp as up to date, so make does not reinstall the package
    proc = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "pipeline-run", "CONFIG=configs/demo.yaml",
         "WAIT=1", "IMAGE_REGISTRY=reg.test/team", "IMAGE_TAG=0.9.0-gfeed",
         "RUN_NAME=nightly 42"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Health check, pipeline lookup, upload, its named version, experiment, a run of that
    # name (none), the run, polling.
    assert state.paths() == [
        ("GET", f"{API}/healthz"), ("GET", f"{API}/healthz"),
        ("GET", f"{API}/pipelines"), ("POST", f"{API}/pipelines/upload"),
        ("POST", f"{API}/pipelines/upload_version"),
        ("GET", f"{API}/experiments"), ("POST", f"{API}/experiments"),
        ("GET", f"{API}/runs"), ("POST", f"{API}/runs"), ("GET", f"{API}/runs/run-1"),
    ]
    assert all(r.headers.get("authorization") == "Bearer t0ken" for r in state.requests)

    upload = state.one("POST", f"{API}/pipelines/upload")
    assert upload.query["name"] == ["shardrl"]
    spec = next(yaml.safe_load_all(upload.uploaded_file()))
    assert spec["pipelineInfo"]["name"] == "shardrl"
    # IMAGE_REGISTRY and IMAGE_TAG reach the compiled package
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images and all(i.startswith("reg.test/team/") and i.endswith(":0.9.0-gfeed")
                          for i in images), images

    # the config sent is the file's, with the KFP UI's address for the MLflow run's link
    expected_config = config_text(load_config(ROOT / "configs/demo.yaml",
                                              [f"pipeline.ui_endpoint={host}"]))
    assert state.one("POST", f"{API}/experiments").json()["display_name"] == "shardrl"
    # the run uses the version named after the package, so resubmitting it finds that one
    named = state.one("POST", f"{API}/pipelines/upload_version")
    assert named.query["name"] == [version_name_of(named)]
    run = state.one("POST", f"{API}/runs").json()
    assert run["experiment_id"] == "exp-1"
    assert run["pipeline_version_reference"] == {"pipeline_id": "pl-1",
                                                 "pipeline_version_id": "pv-2"}
    assert run["runtime_config"]["parameters"] == {"config": expected_config,
                                                   "store": DEFAULT_STORE}
    assert run["service_account"] == SERVICE_ACCOUNT
    assert run["display_name"] == "nightly 42"  # RUN_NAME, looked up first
    assert f"{host}/#/runs/details/run-1" in proc.stdout
    assert "finished: SUCCEEDED" in proc.stdout


def test_existing_pipeline_gets_a_new_version_and_a_failed_run_fails(kfp_api, tmp_path,
                                                                      monkeypatch, capsys):
    host, state = kfp_api
    state.existing_pipeline = True
    state.final_state = "FAILED"
    token_file = tmp_path / "token"
    token_file.write_text("sa-token\n")
    monkeypatch.delenv("KFP_TOKEN", raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_SERVICE_ACCOUNT", "")

    rc = cli_main(["pipeline", "run", "demo", "--pipeline", "shardrl-sync",
                   "--experiment", "nightly", "--wait"])

    assert rc == 1
    assert "finished: FAILED" in capsys.readouterr().out
    assert ("POST", f"{API}/pipelines/upload") not in state.paths()
    assert all(r.headers.get("authorization") == "Bearer sa-token" for r in state.requests)
    new_version = state.one("POST", f"{API}/pipelines/upload_version")
    assert new_version.query["pipelineid"] == ["pl-1"]
    package = tmp_path / "sync.yaml"
    package.write_bytes(new_version.uploaded_file())
    # The version is named after the package version and the uploaded bytes' hash.
    assert new_version.query["name"] == [version_name(package)]
    assert next(yaml.safe_load_all(package.read_text()))["pipelineInfo"]["name"] == "shardrl-sync"
    run = state.one("POST", f"{API}/runs").json()
    assert run["pipeline_version_reference"]["pipeline_version_id"] == "pv-2"
    assert "service_account" not in run  # empty KFP_SERVICE_ACCOUNT: the backend's default
    assert state.one("POST", f"{API}/experiments").json()["display_name"] == "nightly"


def test_resubmitting_the_same_config_reuses_its_version(kfp_api, monkeypatch):
    host, state = kfp_api
    state.existing_pipeline = True
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_TOKEN", "t")
    assert cli_main(["pipeline", "run", "demo"]) == 0
    uploaded_name = state.one("POST", f"{API}/pipelines/upload_version").query["name"][0]

    # Compilation is deterministic: the second submission finds its version by name.
    state.existing_version = uploaded_name
    state.requests.clear()
    assert cli_main(["pipeline", "run", "demo"]) == 0
    versions = state.one("GET", f"{API}/pipelines/pl-1/versions")
    assert json.loads(versions.query["filter"][0])["predicates"][0]["stringValue"] == uploaded_name
    assert ("POST", f"{API}/pipelines/upload_version") not in state.paths()
    run = state.one("POST", f"{API}/runs").json()
    assert run["pipeline_version_reference"]["pipeline_version_id"] == "pv-1"


def test_multi_user_pipelines_are_the_namespaces_own(kfp_api, monkeypatch):
    """With KFP_NAMESPACE the pipeline is looked up and uploaded in that namespace (private
    to it), not as a shared pipeline every namespace sees, and the experiment is made there."""
    host, state = kfp_api
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_TOKEN", "t")
    monkeypatch.setenv("KFP_NAMESPACE", "team-a")
    assert cli_main(["pipeline", "run", "demo"]) == 0
    lookup = state.one("GET", f"{API}/pipelines")
    assert lookup.query["namespace"] == ["team-a"]
    assert json.loads(lookup.query["filter"][0])["predicates"][0]["stringValue"] == "shardrl"
    assert state.one("POST", f"{API}/pipelines/upload").query["namespace"] == ["team-a"]
    assert state.one("POST", f"{API}/experiments").json()["namespace"] == "team-a"

    state.existing_pipeline, state.existing_version = True, None
    state.requests.clear()
    assert cli_main(["pipeline", "run", "demo"]) == 0
    assert state.one("GET", f"{API}/pipelines").query["namespace"] == ["team-a"]
    assert ("POST", f"{API}/pipelines/upload") not in state.paths()
    assert state.one("POST", f"{API}/pipelines/upload_version").query["pipelineid"] == ["pl-1"]


def test_without_kfp_host_the_local_runner_runs_the_config(monkeypatch, capsys):
    monkeypatch.delenv("KFP_HOST", raising=False)
    monkeypatch.delenv("REQUIRE_CLUSTER", raising=False)
    calls = []

    def fake_run(cmd, check):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert cli_main(["pipeline", "run", "configs/demo.yaml"]) == 3  # the runner's exit code
    assert calls == [[sys.executable, "-m", "shardrl.cli", "run", "configs/demo.yaml"]]
    assert "running the pipeline locally" in capsys.readouterr().err
    # REQUIRE_CLUSTER=1 (or --require-cluster): no local run, an error
    calls.clear()
    monkeypatch.setenv("REQUIRE_CLUSTER", "1")
    assert cli_main(["pipeline", "run", "configs/demo.yaml"]) == 2
    monkeypatch.delenv("REQUIRE_CLUSTER")
    assert cli_main(["pipeline", "run", "configs/demo.yaml", "--require-cluster"]) == 2
    assert calls == []
    assert "a cluster is required" in capsys.readouterr().err
    # the synchronous pipeline has no local runner: refused, not run as the asynchronous one
    assert cli_main(["pipeline", "run", "configs/demo.yaml", "--pipeline", "shardrl-sync"]) == 2
    assert calls == []
    assert "--pipeline shardrl-sync runs on a cluster only" in capsys.readouterr().err


def test_make_pipeline_run_with_require_cluster_fails_without_kfp_host(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KFP_HOST", "REQUIRE_CLUSTER")}
    proc = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "pipeline-run", "CONFIG=configs/demo.yaml",
         "REQUIRE_CLUSTER=1"], cwd=ROOT, env={**env, "HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "KFP_HOST is not set and a cluster is required" in proc.stderr
    assert "running the pipeline locally" not in proc.stderr


def test_an_unreachable_api_or_refused_credentials_are_one_line(kfp_api, monkeypatch, capsys):
    """No traceback and no 25 s of the SDK's retries: what is wrong, in one line."""
    import socket

    host, state = kfp_api
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("KFP_TOKEN", "wrong")
    for where, expected in ((closed, f"cannot reach the Kubeflow Pipelines API at {closed}"),
                            (host, f"the Kubeflow Pipelines API at {host} refused the "
                                   "credentials (HTTP 401)")):
        state.token = "right"
        monkeypatch.setenv("KFP_HOST", where)
        assert cli_main(["pipeline", "run", "demo"]) == 1
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    state.login_page = True
    assert cli_main(["pipeline", "run", "demo"]) == 1
    err = capsys.readouterr().err
    assert "answered text/html, not the Kubeflow Pipelines API's JSON" in err, err
    assert ("POST", f"{API}/runs") not in state.paths()  # nothing was submitted


def test_a_wait_that_times_out_says_the_run_goes_on(kfp_api, monkeypatch, capsys):
    """A run still going when the wait gives up: one line and its own status, not a
    traceback and exit 1, which a CI retry would answer with a second run."""
    import pipelines.submit as submit_module
    from shardrl.commands import pipeline_cmd

    host, state = kfp_api
    state.final_state = "RUNNING"
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_TOKEN", "t")
    monkeypatch.setattr(submit_module, "POLL_S", 0.01)
    monkeypatch.setattr(pipeline_cmd, "WAIT_TIMEOUT_S", 0.05)
    assert cli_main(["pipeline", "run", "demo", "--wait"]) == 124
    captured = capsys.readouterr()
    assert "run run-1: " in captured.out  # its link, printed before the wait
    # its last line (an earlier test's logging handler may complain above it)
    assert captured.err.strip().splitlines()[-1].startswith(
        "shardrl pipeline run: run run-1 still RUNNING after 0s: stopped waiting; the run "
        "goes on")
    assert len([r for r in state.requests if (r.method, r.path) == ("POST", f"{API}/runs")]) == 1


def test_waiting_survives_failed_polls_and_a_rotated_token(kfp_api, tmp_path, monkeypatch,
                                                          capsys):
    """The API restarting (503s) and a service-account token rotated while the run goes on:
    the wait polls again on a new client that reads the token file anew."""
    import pipelines.submit as submit_module

    host, state = kfp_api
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    monkeypatch.delenv("KFP_TOKEN", raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setattr(submit_module, "POLL_S", 0.01)
    state.failing_polls = 2

    polls = 0
    answer = state.answer

    def rotate(req):  # the token file changes after the run is created
        nonlocal polls
        if (req.method, req.path) == ("GET", f"{API}/runs/run-1"):
            polls += 1
            if polls == 2:
                token_file.write_text("second\n")
                state.token = "second"
        return answer(req)

    monkeypatch.setattr(state, "answer", rotate)
    assert cli_main(["pipeline", "run", "demo", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "finished: SUCCEEDED" in out and out.count("polling run run-1 failed") >= 2, out
    last = [r for r in state.requests if r.path == f"{API}/runs/run-1"][-1]
    assert last.headers["authorization"] == "Bearer second"


def test_a_poll_the_api_never_answers_times_out_and_is_tried_again(kfp_api, monkeypatch,
                                                                    capsys):
    """An API that takes a request and never answers held the SDK's call for ever (it sets no
    timeout), and `--wait` with it. Each request is bounded now: the stalled poll gives up
    and is asked again (by the HTTP client's own retry, or as a failed poll), and the next
    answer finds the run finished."""
    import time

    import pipelines.submit as submit_module

    host, state = kfp_api
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setattr(submit_module, "POLL_S", 0.01)
    monkeypatch.setattr(submit_module, "REQUEST_TIMEOUT_S", 0.5)
    answer, polls = state.answer, []

    def stall_once(req):
        if (req.method, req.path) == ("GET", f"{API}/runs/run-1"):
            polls.append(time.monotonic())
            if len(polls) == 1:
                time.sleep(3.0)  # past the bound: the client gives up on it first
        return answer(req)

    monkeypatch.setattr(state, "answer", stall_once)
    started = time.monotonic()
    assert cli_main(["pipeline", "run", "demo", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "finished: SUCCEEDED" in out, out
    assert len(polls) >= 2 and polls[1] - polls[0] < 2.5  # asked again before the stall ended
    assert time.monotonic() - started < 30

    # a poll that never gets an answer, tries included, then a new client whose own health
    # check gets none either: the wait goes on, on the client it had
    state.requests.clear()
    polls.clear()
    stalled_health = []

    def stall_more(req):
        if (req.method, req.path) == ("GET", f"{API}/runs/run-2"):
            polls.append(time.monotonic())
            if len(polls) <= 4:  # the first poll and its 3 retries
                time.sleep(2.0)
        elif req.path.endswith("/healthz") and polls and not stalled_health:
            stalled_health.append(req)
            time.sleep(30.0)  # unbounded, the new client would wait this out
        return answer(req)

    monkeypatch.setattr(state, "answer", stall_more)
    started = time.monotonic()
    assert cli_main(["pipeline", "run", "demo", "--wait"]) == 0
    out = capsys.readouterr().out
    assert "run run-2 finished: SUCCEEDED" in out and "polling run run-2 failed" in out, out
    assert stalled_health and time.monotonic() - started < 25


def test_a_run_whose_creation_got_no_answer_is_found_by_name(kfp_api, monkeypatch, capsys):
    """The API created the run and the connection closed before its answer: the submission
    finds that run by its name instead of failing (which a CI retry would answer with a
    second run)."""
    host, state = kfp_api
    state.lost_run_answers = 1
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_TOKEN", "t")
    assert cli_main(["pipeline", "run", "demo", "--wait"]) == 0
    captured = capsys.readouterr()
    assert "finished: SUCCEEDED" in captured.out
    assert "run run-1: the answer to creating it was lost" in captured.err, captured.err
    assert [r["run_id"] for r in state.runs] == ["run-1"]
    lookup = state.one("GET", f"{API}/runs")
    assert lookup.query["experiment_id"] == ["exp-1"]
    assert (json.loads(lookup.query["filter"][0])["predicates"][0]["stringValue"]
            == state.runs[0]["display_name"])

    # unnamed submissions are never looked up otherwise, and never collide with each other
    state.requests.clear()
    assert cli_main(["pipeline", "run", "demo"]) == 0
    assert cli_main(["pipeline", "run", "demo"]) == 0
    assert ("GET", f"{API}/runs") not in state.paths()
    assert len({r["display_name"] for r in state.runs}) == 3


def test_a_named_run_that_exists_is_followed_not_started_again(kfp_api, monkeypatch, capsys):
    """`--run-name` (make's RUN_NAME): a retried CI job follows the run its first try started."""
    host, state = kfp_api
    state.final_state = "FAILED"
    monkeypatch.setenv("KFP_HOST", host)
    monkeypatch.setenv("KFP_TOKEN", "t")
    assert cli_main(["pipeline", "run", "demo", "--run-name", "ci-1234"]) == 0
    assert [(r["run_id"], r["display_name"]) for r in state.runs] == [("run-1", "ci-1234")]
    capsys.readouterr()

    state.requests.clear()
    assert cli_main(["pipeline", "run", "demo", "--run-name", "ci-1234", "--wait"]) == 1
    captured = capsys.readouterr()
    assert ("POST", f"{API}/runs") not in state.paths()
    assert "run run-1: a run named ci-1234 exists in experiment shardrl: taken as this " \
           "submission, not started again" in captured.err, captured.err
    assert "run run-1 finished: FAILED" in captured.out
    # another name starts its own run
    assert cli_main(["pipeline", "run", "demo", "--run-name", "ci-1235"]) == 0
    assert [r["display_name"] for r in state.runs] == ["ci-1234", "ci-1235"]
    capsys.readouterr()
    # the name reused for another config is refused, not taken as a retry
    state.requests.clear()
    assert cli_main(["pipeline", "run", "calculator", "--run-name", "ci-1234"]) == 1
    err = capsys.readouterr().err
    assert "a run named ci-1234 exists in experiment shardrl (run-1) with other parameters " \
           "(another config): it is not this submission's first try; give another " \
           "--run-name" in err, err
    assert ("POST", f"{API}/runs") not in state.paths()


def test_a_run_of_another_pipeline_or_package_is_not_a_retry():
    from types import SimpleNamespace as NS

    from pipelines.submit import _differs

    def run(pipeline, version, config):
        return NS(pipeline_version_reference=NS(pipeline_id=pipeline, pipeline_version_id=version),
                  runtime_config=NS(parameters={"config": config, "store": "s3://x"}))

    params = {"config": "c", "store": "s3://x"}
    assert _differs(run("pl-1", "pv-1", "c"), "pl-1", "pv-1", params) is None
    assert _differs(run("pl-2", "pv-1", "c"), "pl-1", "pv-1", params) == "another pipeline"
    assert _differs(run("pl-1", "pv-2", "c"), "pl-1", "pv-1", params).startswith(
        "another compiled package")
    assert _differs(run("pl-1", "pv-1", "d"), "pl-1", "pv-1", params).startswith(
        "other parameters")
    with pytest.raises(SystemExit):
        cli_main(["pipeline", "run", "demo", "--run-name", " "])
