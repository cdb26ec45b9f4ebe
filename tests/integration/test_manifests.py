"""Render the kustomize overlays and check they agree with the compiled pipeline and are safe."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from components import SERVICE_IMAGES, STAGE_IMAGES, image_ref
from pipelines import cluster
from pipelines.shardrl import compile_pipelines
from shardrl.config import load_config
from shardrl.config.infra import PipelineConfig

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("kubeflow", "standalone")
WORKLOADS = ("Deployment", "StatefulSet", "Job")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def render(overlay: str) -> dict[tuple[str, str], dict]:
    """`kubectl kustomize manifests/overlays/<overlay>`, indexed by (kind, name)."""
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "manifests/overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    objects = [o for o in yaml.safe_load_all(out) if o]
    index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(index) == len(objects), "duplicate objects"
    return index


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, render(request.param)


@pytest.fixture(scope="module")
def pipeline_secrets(tmp_path_factory) -> dict[str, tuple[set[str], set[str]]]:
    """Secret name -> (required keys, optional keys) as the compiled pipeline reads them."""
    path = compile_pipelines(load_config("demo"), tmp_path_factory.mktemp("ir"),
                             names=("shardrl",))["shardrl"]
    _, platform = yaml.safe_load_all(path.read_text())
    secrets: dict[str, tuple[set[str], set[str]]] = {}
    for executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        for entry in executor["secretAsEnv"]:
            required, optional = secrets.setdefault(entry["secretName"], (set(), set()))
            for pair in entry["keyToEnv"]:
                assert pair["secretKey"] == pair["envVar"]
                (optional if entry["optional"] else required).add(pair["secretKey"])
    return secrets


def secret_data(objects: dict, name: str) -> dict[str, str]:
    secret = objects[("Secret", name)]
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def pod_specs(objects: dict) -> dict[str, dict]:
    return {name: o["spec"]["template"]["spec"] for (kind, name), o in objects.items()
            if kind in WORKLOADS}


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def test_secrets_have_exactly_the_keys_the_pipeline_reads(rendered, pipeline_secrets):
    _, objects = rendered
    assert pipeline_secrets == {
        "shardrl-s3": ({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL"}, set()),
        "shardrl-mlflow": ({"MLFLOW_TRACKING_URI"},
                           {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}),
    }
    for name, (required, optional) in pipeline_secrets.items():
        keys = set(secret_data(objects, name))
        assert required <= keys <= required | optional, name


def test_tracking_uri_points_at_the_mlflow_service(rendered):
    _, objects = rendered
    uri = urlparse(secret_data(objects, "shardrl-mlflow")["MLFLOW_TRACKING_URI"])
    assert (uri.scheme, uri.hostname, uri.port) == ("http", "mlflow", 5000)
    assert (uri.hostname, uri.port) == (cluster.MLFLOW_SERVICE, cluster.MLFLOW_PORT)
    assert_service_reaches(objects, uri.hostname, uri.port, "mlflow")


def assert_service_reaches(objects: dict, service: str, port: int, workload: str) -> None:
    """Service `service` exposes `port`, and its target port is a port of `workload`'s pods."""
    svc = objects[("Service", service)]
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    pod = objects[("Deployment", workload)]["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert svc_port["targetPort"] in ports or svc_port["targetPort"] in ports.values()


def test_s3_endpoint_is_the_overlays_object_store(rendered):
    overlay, objects = rendered
    endpoint = urlparse(secret_data(objects, "shardrl-s3")["S3_ENDPOINT_URL"])
    if overlay == "kubeflow":
        # Kubeflow's own store, not rendered here: its Service in the kubeflow namespace.
        assert (endpoint.hostname, endpoint.port) == ("minio-service.kubeflow", 9000)
        assert (endpoint.hostname, endpoint.port) == (cluster.KUBEFLOW_S3_SERVICE,
                                                      cluster.KUBEFLOW_S3_PORT)
        assert ("Deployment", "seaweedfs") not in objects
    else:
        assert (endpoint.hostname, endpoint.port) == ("seaweedfs", 8333)
        assert_service_reaches(objects, "seaweedfs", 8333, "seaweedfs")


def test_bucket_and_artifact_store_match_the_pipeline_store(rendered):
    _, objects = rendered
    job = objects[("Job", "shardrl-bucket-init")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in job["containers"][0]["env"]}
    assert env["BUCKET"] == cluster.BUCKET == "shardrl"
    assert cluster.DEFAULT_STORE == f"s3://{env['BUCKET']}"
    args = objects[("Deployment", "mlflow")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--artifacts-destination=s3://{cluster.BUCKET}/mlflow" in args


def test_every_secret_reference_resolves(rendered):
    _, objects = rendered
    for name, spec in pod_specs(objects).items():
        for c in containers(spec):
            for source in c.get("envFrom", []):
                assert ("Secret", source["secretRef"]["name"]) in objects, name
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secret_data(objects, ref["name"]), (name, ref)


def test_runner_service_account_has_least_privilege(rendered):
    _, objects = rendered
    assert ("ServiceAccount", cluster.SERVICE_ACCOUNT) in objects
    binding = objects[("RoleBinding", cluster.SERVICE_ACCOUNT)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": cluster.SERVICE_ACCOUNT,
                                    "namespace": binding["metadata"]["namespace"]}]
    role = objects[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
    assert binding["roleRef"]["kind"] == "Role"  # namespaced, never a ClusterRole
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        verbs = set(rule["verbs"])
        assert not verbs & {"delete", "deletecollection", "update", "escalate", "bind"}
        if "create" in verbs:  # only the Argo executor's task results
            assert rule["resources"] == ["workflowtaskresults"]
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"] and rule["resourceNames"]


def test_containers_are_non_root_and_unprivileged(rendered):
    _, objects = rendered
    for name, spec in pod_specs(objects).items():
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for c in containers(spec):
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0, (name, c["name"])
            assert ctx["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert ctx["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert not ctx.get("privileged", False)


def test_images_are_pinned_and_ours_carry_the_package_version(rendered):
    _, objects = rendered
    registry = PipelineConfig().image_registry
    ours = {image_ref(spec, registry) for spec in (*STAGE_IMAGES.values(),
                                                   *SERVICE_IMAGES.values())}
    for name, spec in pod_specs(objects).items():
        for c in containers(spec):
            image = c["image"]
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            assert tag and tag != "latest", (name, image)
            if image.startswith(registry + "/"):
                assert image in ours, (name, image)


def test_one_namespace_per_overlay(rendered):
    overlay, objects = rendered
    namespaces = {o["metadata"].get("namespace") for o in objects.values()}
    assert namespaces == {"kubeflow-user-example-com" if overlay == "kubeflow" else "kubeflow"}
