"""Submit a compiled pipeline to a Kubeflow Pipelines API and optionally wait for the run.

Auth: `KFP_TOKEN`, else the service-account token file at `KF_PIPELINES_SA_TOKEN_PATH` (the
path KFP mounts in pods), else none (a port-forwarded API). The pipeline is uploaded once by
name; each distinct compiled package becomes a version named `<package version>-<hash>`, so
submitting the same package twice reuses its version.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardrl import __version__

DEFAULT_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
FINAL_STATES = ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED")


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


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [
        {"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def ensure_version(client: Any, package: Path, pipeline: str, description: str) -> tuple[str, str]:
    """(pipeline id, version id) of `package`, uploading the pipeline or a version if needed."""
    pipeline_id = client.get_pipeline_id(pipeline)
    if pipeline_id is None:
        created = client.upload_pipeline(str(package), pipeline_name=pipeline,
                                         description=description)
        # Uploading a new pipeline creates its first version from the same package.
        versions = client.list_pipeline_versions(created.pipeline_id, page_size=1,
                                                 sort_by="created_at desc")
        return created.pipeline_id, versions.pipeline_versions[0].pipeline_version_id
    name = version_name(package)
    found = client.list_pipeline_versions(pipeline_id, page_size=1, filter=_name_filter(name))
    if found.pipeline_versions:
        return pipeline_id, found.pipeline_versions[0].pipeline_version_id
    version = client.upload_pipeline_version(str(package), name, pipeline_id=pipeline_id,
                                             description=description)
    return pipeline_id, version.pipeline_version_id


def wait_for_run(client: Any, run_id: str, *, timeout_s: float, poll_s: float = 10.0) -> str:
    """Poll the run until it reaches a final state; return that state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = str(client.get_run(run_id).state or "").upper()
        if state in FINAL_STATES:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {state or 'pending'} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def submit(package: Path, *, host: str, pipeline: str, description: str, experiment: str,
           run_name: str, params: dict[str, Any], env: Mapping[str, str],
           service_account: str | None = None, wait_timeout_s: float | None = None,
           ) -> SubmitResult:
    """Upload `package` (or reuse it), create a run in `experiment`, and wait if asked.

    `env` supplies KFP_TOKEN / KF_PIPELINES_SA_TOKEN_PATH, KFP_NAMESPACE (multi-user) and
    KF_PIPELINES_UI_ENDPOINT (base URL of run links, default `host`).
    """
    import kfp  # heavy: imported only when submitting

    namespace = env.get("KFP_NAMESPACE") or None
    with warnings.catch_warnings():  # "only works with KFP v2.0.0-beta.2 and later"
        warnings.simplefilter("ignore", FutureWarning)
        client = kfp.Client(host=host, existing_token=kfp_token(env),
                            namespace=namespace or "kubeflow")
    client.get_kfp_healthz()
    pipeline_id, version_id = ensure_version(client, package, pipeline, description)
    exp = client.create_experiment(name=experiment, namespace=namespace)
    run = client.run_pipeline(experiment_id=exp.experiment_id, job_name=run_name,
                              params=params, pipeline_id=pipeline_id, version_id=version_id,
                              service_account=service_account or None)
    ui = (env.get("KF_PIPELINES_UI_ENDPOINT") or host).rstrip("/")
    url = f"{ui}/#/runs/details/{run.run_id}"
    state = None
    if wait_timeout_s is not None:
        state = wait_for_run(client, run.run_id, timeout_s=wait_timeout_s)
    return SubmitResult(pipeline_id, version_id, exp.experiment_id, run.run_id, url, state)
