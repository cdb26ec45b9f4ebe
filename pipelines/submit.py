"""Submit a compiled pipeline to a Kubeflow Pipelines API and optionally wait for the run.

Auth: `KFP_TOKEN`, else the service-account token file at `KF_PIPELINES_SA_TOKEN_PATH` (the
path KFP mounts in pods), else none (a port-forwarded API). The pipeline is uploaded once by
name; each distinct compiled package becomes a version named `<package version>-<hash>`, so
submitting the same package twice reuses its version. An unreachable API, rejected
credentials or an SDK error end in a `SubmitError` whose message is one line; a wait survives
failed polls on a new client that reads the token again (a pod's token is rotated).

A run is found again by its name in its experiment: when the answer to creating it was lost
(the connection cut, a 5xx from a proxy) before a second request could create another, and,
with `reuse_named`, before creating one at all, so that a CI job retried with the same run name
follows the run its first try started instead of starting a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardrl import __version__
from shardrl.redact import has_userinfo, without_userinfo

DEFAULT_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
FINAL_STATES = ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED")
POLL_S = 10.0
"""Seconds between polls of a run waited for."""
REQUEST_TIMEOUT_S = 30.0
"""How long one request to the API may take to connect, and then to read: the SDK's own
default is to wait for ever, so an API that accepts a connection and never answers held a
`--wait` past its deadline. Its HTTP client tries a request that timed out up to 3 times
more, so one call gives up after about 4 x this."""


@dataclass(frozen=True)
class SubmitResult:
    """What a submission created or reused."""

    pipeline_id: str
    version_id: str
    experiment_id: str
    run_id: str
    url: str
    state: str | None = None
    """Final state when waited for, else None."""
    found: str | None = None
    """Why an existing run was taken instead of a new one (None: this call created it)."""


def kfp_token(env: Mapping[str, str]) -> str | None:
    """`KFP_TOKEN`, else the contents of the service-account token file if it exists."""
    if env.get("KFP_TOKEN"):
        return env["KFP_TOKEN"]
    path = Path(env.get("KF_PIPELINES_SA_TOKEN_PATH") or DEFAULT_TOKEN_PATH)
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def version_name(package: Path) -> str:
    """Version name of a compiled package: package version plus a content hash."""
    digest = hashlib.sha256(package.read_bytes()).hexdigest()[:12]
    return f"{__version__}-{digest}"


def find_run(client: Any, experiment_id: str, name: str) -> Any | None:
    """The newest run named `name` in the experiment, or None."""
    found = client.list_runs(experiment_id=experiment_id, page_size=1, filter=_name_filter(name),
                             sort_by="created_at desc")
    return found.runs[0] if found.runs else None


def _differs(run: Any, pipeline_id: str, version_id: str, params: dict[str, Any]) -> str | None:
    """What makes an existing run another submission than this one (another pipeline, package
    or parameters: a name reused, not a retry), or None."""
    ref = run.pipeline_version_reference
    if ref is None or ref.pipeline_id != pipeline_id:
        return "another pipeline"
    if ref.pipeline_version_id != version_id:
        return "another compiled package (the code, the config or the image tag changed)"
    given = (run.runtime_config.parameters if run.runtime_config else None) or {}
    if any(given.get(k) != v for k, v in params.items()):
        return "other parameters (another config)"
    return None


def _answer_lost(exc: BaseException) -> bool:
    """Whether a failed request may still have been carried out: no answer came (a connection
    error), or a gateway's 5xx stands where the API's answer should be."""
    status = getattr(exc, "status", None)
    if type(exc).__name__ == "ApiException":
        return not status or status >= 500
    return isinstance(exc, OSError) or type(exc).__module__.startswith("urllib3")


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [
        {"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def ensure_version(client: Any, package: Path, pipeline: str, description: str,
                   namespace: str | None = None) -> tuple[str, str]:
    """(pipeline id, version id) of `package`, uploading the pipeline or a version if needed.
    With `namespace` (multi-user Kubeflow) the pipeline is that namespace's own, looked up and
    uploaded there; without, it is a shared one."""
    if namespace:
        found = client.list_pipelines(page_size=1, filter=_name_filter(pipeline),
                                      namespace=namespace).pipelines
        pipeline_id = found[0].pipeline_id if found else None
    else:
        pipeline_id = client.get_pipeline_id(pipeline)
    name = version_name(package)
    if pipeline_id is None:
        # Uploading a new pipeline also makes a first version, named after the pipeline, which
        # a later submission of this package could not find by name: the package goes up
        # again as a version named `version_name`, which runs and is found next time.
        created = client.upload_pipeline(str(package), pipeline_name=pipeline,
                                         description=description, namespace=namespace)
        version = client.upload_pipeline_version(str(package), name,
                                                 pipeline_id=created.pipeline_id,
                                                 description=description)
        return created.pipeline_id, version.pipeline_version_id
    found = client.list_pipeline_versions(pipeline_id, page_size=1, filter=_name_filter(name))
    if found.pipeline_versions:
        return pipeline_id, found.pipeline_versions[0].pipeline_version_id
    version = client.upload_pipeline_version(str(package), name, pipeline_id=pipeline_id,
                                             description=description)
    return pipeline_id, version.pipeline_version_id


class SubmitError(RuntimeError):
    """The API could not be reached, refused the credentials or answered an error: the
    message says which, in one line."""


def check_api(host: str, token: str | None, timeout_s: float = 15.0) -> None:
    """One request to the API's health endpoint, so that a wrong host, an API that is not
    forwarded, rejected credentials or a login page in front of the API is said plainly
    (the SDK retries its own check for 25 s and logs each failure's traceback)."""
    import urllib.error
    import urllib.request

    if has_userinfo(host):
        raise SubmitError("KFP_HOST holds credentials (user:password@): give the address alone "
                          "and the token in KFP_TOKEN")
    url = f"{host.rstrip('/')}/apis/v2beta1/healthz"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body, kind = response.read(1 << 16), response.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise SubmitError(
                f"the Kubeflow Pipelines API at {host} refused the credentials (HTTP {exc.code}):"
                " set KFP_TOKEN, or KF_PIPELINES_SA_TOKEN_PATH to a valid token file") from None
        raise SubmitError(f"the Kubeflow Pipelines API at {host} answered HTTP {exc.code} "
                          f"{exc.reason} on {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SubmitError(f"cannot reach the Kubeflow Pipelines API at {host}: {reason} (is "
                          "KFP_HOST right, and the API reachable or port-forwarded?)") from None
    try:
        json.loads(body)
    except ValueError:
        raise SubmitError(
            f"{url} answered {kind}, not the Kubeflow Pipelines API's JSON (a login page in "
            "front of the API? set KFP_TOKEN)") from None


def api_error(exc: BaseException, host: str, doing: str) -> SubmitError | None:
    """An `ApiException` of the SDK (or a connection error under it) as one line; None for
    anything else."""
    status = getattr(exc, "status", None)
    if type(exc).__name__ == "ApiException":
        if status in (401, 403):
            return SubmitError(f"the Kubeflow Pipelines API at {host} refused the credentials "
                               f"while {doing} (HTTP {status})")
        if status:
            return SubmitError(f"the Kubeflow Pipelines API at {host} answered HTTP {status} "
                               f"{getattr(exc, 'reason', '')} while {doing}".rstrip())
        return SubmitError(f"cannot reach the Kubeflow Pipelines API at {host} while {doing}: "
                           f"{getattr(exc, 'reason', exc)}")
    if isinstance(exc, OSError) or type(exc).__module__.startswith("urllib3"):
        return SubmitError(f"cannot reach the Kubeflow Pipelines API at {host} while {doing}: "
                           f"{exc}")
    return None


def wait_for_run(client: Any, run_id: str, *, timeout_s: float, poll_s: float = 10.0,
                 reconnect: Callable[[], Any] | None = None, max_failures: int = 30,
                 host: str = "the API", log: Callable[[str], None] = print) -> str:
    """Poll the run until it reaches a final state; return that state.

    A poll that fails (the API restarting, a network blip, a token rotated and expired in the
    meantime) is retried on a new client from `reconnect` (which reads the token again), until
    `max_failures` polls in a row have failed."""
    deadline = time.monotonic() + timeout_s
    failures = 0
    while True:
        try:
            state = str(client.get_run(run_id).state or "").upper()
            failures = 0
        except Exception as exc:  # noqa: BLE001 - sorted by api_error; the rest raise
            failures += 1
            error = api_error(exc, host, f"waiting for run {run_id} ({failures} polls in a "
                              "row failed)")
            if error is None:
                raise
            if failures >= max_failures:
                raise error from None
            log(f"polling run {run_id} failed ({type(exc).__name__} "
                f"{getattr(exc, 'status', '') or ''}); trying again in {poll_s:g} s "
                f"({failures}/{max_failures})")
            state = ""
            if reconnect is not None:
                try:
                    client = reconnect()
                except Exception as again:  # noqa: BLE001 - the API still not answering:
                    if api_error(again, host, "reconnecting") is None:  # the next poll
                        raise  # counts it, on the client it has

        if state in FINAL_STATES:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {state or 'pending'} after {timeout_s:.0f}s")
        time.sleep(poll_s)


@contextlib.contextmanager
def bounded_requests(timeout_s: float) -> Iterator[None]:
    """Inside, every request of the KFP SDK's REST client is bounded by `timeout_s` (to
    connect, then to read): the SDK's per-call `_request_timeout`, which `kfp.Client`'s
    methods never pass, and which its constructor's own health check needs too. A request
    that times out raises urllib3's timeout error, which `api_error` reads as no answer."""
    from kfp_server_api import rest

    request = rest.RESTClientObject.request
    bound = (timeout_s, timeout_s)  # (connect, read): the SDK ignores a float given alone

    def with_timeout(self: Any, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(self, *args, _request_timeout=_request_timeout or bound, **kwargs)

    rest.RESTClientObject.request = with_timeout
    try:
        yield
    finally:
        rest.RESTClientObject.request = request


def submit(package: Path, **kwargs: Any) -> SubmitResult:
    """`_submit`, with every request to the API bounded (`REQUEST_TIMEOUT_S`)."""
    with bounded_requests(REQUEST_TIMEOUT_S):
        return _submit(package, **kwargs)


def _submit(package: Path, *, host: str, pipeline: str, description: str, experiment: str,
            run_name: str, params: dict[str, Any], env: Mapping[str, str],
            service_account: str | None = None, wait_timeout_s: float | None = None,
            reuse_named: bool = False) -> SubmitResult:
    """Upload `package` (or reuse it), create a run in `experiment`, and wait if asked.

    With `reuse_named`, a run named `run_name` in `experiment` is taken as this submission's
    (whatever its state) and nothing is created. A creation whose answer was lost is looked up
    by `run_name` before it counts as failed.

    `env` supplies KFP_TOKEN / KF_PIPELINES_SA_TOKEN_PATH, KFP_NAMESPACE (multi-user) and
    KF_PIPELINES_UI_ENDPOINT (base URL of run links, default `host`).
    """
    import kfp  # heavy: imported only when submitting

    namespace = env.get("KFP_NAMESPACE") or None

    def connect():
        with warnings.catch_warnings():  # "only works with KFP v2.0.0-beta.2 and later"
            warnings.simplefilter("ignore", FutureWarning)
            return kfp.Client(host=host, existing_token=kfp_token(env),
                              namespace=namespace or "kubeflow")

    check_api(host, kfp_token(env))
    doing = "uploading the pipeline"
    try:
        client = connect()
        pipeline_id, version_id = ensure_version(client, package, pipeline, description,
                                                 namespace)
        doing = "creating the run"
        exp = client.create_experiment(name=experiment, namespace=namespace)
        run, found = None, None
        if reuse_named and (run := find_run(client, exp.experiment_id, run_name)) is not None:
            if (differs := _differs(run, pipeline_id, version_id, params)) is not None:
                raise SubmitError(f"a run named {run_name} exists in experiment {experiment} "
                                  f"({run.run_id}) with {differs}: it is not this submission's "
                                  "first try; give another --run-name (RUN_NAME)")
            found = f"a run named {run_name} exists in experiment {experiment}"
        if run is None:
            try:
                run = client.run_pipeline(
                    experiment_id=exp.experiment_id, job_name=run_name, params=params,
                    pipeline_id=pipeline_id, version_id=version_id,
                    service_account=service_account or None)
            except Exception as exc:  # noqa: BLE001 - maybe created: looked up, else raised
                if not _answer_lost(exc):
                    raise
                doing = "looking for the run whose creation got no answer"
                if (run := find_run(connect(), exp.experiment_id, run_name)) is None:
                    raise exc from None
                found = f"the answer to creating it was lost ({type(exc).__name__}); found by name"
    except Exception as exc:  # noqa: BLE001 - the SDK's errors as one line; the rest raise
        if (error := api_error(exc, host, doing)) is None:
            raise
        raise error from None
    ui = without_userinfo((env.get("KF_PIPELINES_UI_ENDPOINT") or host).rstrip("/"))
    url = f"{ui}/#/runs/details/{run.run_id}"
    state = None
    if wait_timeout_s is not None:
        print(f"run {run.run_id}: {url} (waiting for it to finish)", flush=True)
        state = wait_for_run(client, run.run_id, timeout_s=wait_timeout_s, poll_s=POLL_S,
                             reconnect=connect, host=host)
    return SubmitResult(pipeline_id, version_id, exp.experiment_id, run.run_id, url, state,
                        found)
