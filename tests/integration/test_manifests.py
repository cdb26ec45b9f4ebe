"""Render the kustomize overlays and check they agree with the compiled pipeline and are safe."""

from __future__ import annotations

import base64
import configparser
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from components import SERVICE_IMAGES, STAGE_IMAGES, image_ref
from overlays import OVERLAYS, ROOT, copy_manifests, generate, kustomize
from overlays import render as render_overlay
from pipelines import cluster
from pipelines.shardrl import compile_pipelines
from shardrl.config import load_config
from shardrl.config.infra import PipelineConfig

WORKLOADS = ("Deployment", "StatefulSet", "Job")
# credentials that ship with MinIO's, Kubeflow's and MLflow's examples, and the placeholders
# these manifests once carried: none may appear in what is applied
DEFAULT_CREDENTIALS = ("minio123", "minioadmin", "password1234", "CHANGE_ME", "changeme")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered_with_credentials(request, tmp_path_factory):
    """(overlay, objects by (kind, name), the generated credentials {KEY: value})."""
    objects, values = render_overlay(tmp_path_factory.mktemp(request.param), request.param)
    index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(index) == len(objects), "duplicate objects"
    return request.param, index, values


@pytest.fixture(scope="module")
def rendered(rendered_with_credentials) -> tuple[str, dict[tuple[str, str], dict]]:
    overlay, index, _ = rendered_with_credentials
    return overlay, index


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
        assert ("Deployment", "shardrl-s3") not in objects
    else:
        assert (endpoint.hostname, endpoint.port) == ("shardrl-s3", 8333)
        assert_service_reaches(objects, "shardrl-s3", 8333, "shardrl-s3")
        # Kubeflow Pipelines' own store is named seaweedfs in the same namespace: nothing
        # here may replace it
        assert not [name for _, name in objects if name.startswith("seaweedfs")]


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


# ---- credentials: generated, never committed, never in an argument -------------------------

def _containers_of(objects: dict):
    for name, spec in pod_specs(objects).items():
        for c in containers(spec):
            yield name, c


def test_no_default_credential_is_rendered_and_no_password_is_an_argument(
        rendered_with_credentials):
    overlay, objects, values = rendered_with_credentials
    text = yaml.safe_dump_all(list(objects.values()))
    decoded = [v for (kind, name) in objects if kind == "Secret"
               for v in secret_data(objects, name).values()]
    for default in DEFAULT_CREDENTIALS:
        assert default.lower() not in text.lower(), (overlay, default)
        assert all(default.lower() not in v.lower() for v in decoded), (overlay, default)
    # every credential of the Secrets is one the generator wrote, random and long
    passwords = {k: v for k, v in values.items() if k.endswith(("PASSWORD", "SECRET_KEY", "SECRET_ACCESS_KEY"))}
    assert set(passwords) == {"POSTGRES_PASSWORD", "MLFLOW_TRACKING_PASSWORD",
                              "AWS_SECRET_ACCESS_KEY", "MLFLOW_FLASK_SERVER_SECRET_KEY"}
    assert all(len(v) >= 32 for v in passwords.values())
    for key, value in passwords.items():
        assert value in decoded, key
    # no container gets a credential on its command line, neither literally nor through
    # $(VAR) expansion of an env var that holds one
    secret_vars = {var["name"] for _, c in _containers_of(objects) for var in c.get("env", [])
                   if var.get("valueFrom", {}).get("secretKeyRef", {}).get("key", "").endswith(
                       ("PASSWORD", "SECRET_KEY", "SECRET_ACCESS_KEY", "TOKEN"))}
    assert {"PGPASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= secret_vars
    for name, c in _containers_of(objects):
        argv = " ".join(c.get("command", []) + c.get("args", []))
        for value in passwords.values():
            assert value not in argv, (overlay, name)
        for var in secret_vars | set(passwords):
            assert f"$({var})" not in argv, (overlay, name, var)
        assert not any(":" in part.split("@")[0].split("://")[-1]
                       for part in argv.split() if "://" in part and "@" in part), (name, argv)


def test_credential_files_are_ignored_by_git_and_only_generated():
    tracked = subprocess.run(["git", "ls-files", "manifests"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert not [f for f in tracked if "/secrets/" in f or f.endswith(".env")], tracked
    for path in ("manifests/base/secrets/mlflow-db.env", "manifests/base/secrets/mlflow-auth.env",
                 *(f"manifests/overlays/{o}/secrets/s3.env" for o in OVERLAYS)):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


def test_rendering_without_generated_credentials_fails_naming_the_file(tmp_path):
    folder = copy_manifests(tmp_path / "manifests")
    for overlay in OVERLAYS:
        res = kustomize(folder, overlay)
        assert res.returncode != 0 and not res.stdout
        assert "secrets/mlflow-auth.env" in res.stderr, res.stderr


def test_generator_keeps_existing_passwords_and_writes_owner_only_files(tmp_path):
    folder = copy_manifests(tmp_path / "manifests")
    first = generate(folder, "standalone")
    assert generate(folder, "standalone") == first  # a second run changes nothing
    for path in [*(folder / "base/secrets").iterdir(), folder / "overlays/standalone/secrets/s3.env"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # the kubeflow overlay needs the keys of Kubeflow's store and says how to get them
    res = subprocess.run([os.environ.get("PYTHON", "python3"), str(folder / "generate-secrets.py"),
                          "kubeflow"], env={"PATH": os.environ["PATH"]}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "mlpipeline-minio-artifact" in res.stderr
    assert not (folder / "overlays/kubeflow/secrets").exists()


# ---- MLflow behind auth, its database behind a NetworkPolicy -------------------------------

def test_mlflow_requires_a_user_and_the_stages_log_in_as_its_admin(rendered):
    _, objects = rendered
    spec = objects[("Deployment", "mlflow")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert "--app-name=basic-auth" in c["args"]
    env = {v["name"]: v for v in c["env"]}
    # the auth app refuses to start without a key for its sessions and CSRF tokens
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
        "shardrl-mlflow-server"
    # the admin user is the one in the Secret the pipeline's stages read
    for var, key in (("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"),
                     ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_TRACKING_PASSWORD")):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": cluster.MLFLOW_AUTH.name,
                                                         "key": key}
        assert key in cluster.MLFLOW_AUTH.keys
    # the auth settings: from a ConfigMap with no credential, every other user without rights,
    # users kept in PostgreSQL (a database the postgres image creates at its first start)
    (mount,) = [m for m in c["volumeMounts"] if env["MLFLOW_AUTH_CONFIG_PATH"]["value"]
                .startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    config_map = objects[("ConfigMap", volume["configMap"]["name"])]
    ini = configparser.ConfigParser()
    ini.read_string(config_map["data"][Path(env["MLFLOW_AUTH_CONFIG_PATH"]["value"]).name])
    assert ini["mlflow"]["default_permission"] == "NO_PERMISSIONS"
    assert "admin_password" not in ini["mlflow"]
    auth_db = urlparse(ini["mlflow"]["database_uri"])
    assert auth_db.password is None and (auth_db.hostname, auth_db.port) == ("mlflow-db", 5432)
    db = objects[("StatefulSet", "mlflow-db")]["spec"]["template"]["spec"]
    (init,) = [v for v in db["volumes"] if v["name"] == "init"]
    sql = "".join(objects[("ConfigMap", init["configMap"]["name"])]["data"].values())
    assert f"CREATE DATABASE {auth_db.path.lstrip('/')};" in sql
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "POSTGRES_PASSWORD"


def test_network_policies_admit_only_who_needs_each_service(rendered):
    overlay, objects = rendered
    policies = {name: o["spec"] for (kind, name), o in objects.items() if kind == "NetworkPolicy"}
    expected = {"mlflow-db": ({"app.kubernetes.io/name": "mlflow"}, 5432),
                "mlflow": ({}, 5000)}
    if overlay == "standalone":
        expected["shardrl-s3"] = ({}, 8333)
    assert set(policies) == set(expected)
    namespace = objects[("Deployment", "mlflow")]["metadata"]["namespace"]
    for name, (source, port) in expected.items():
        spec = policies[name]
        assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        # pods of this namespace only (no namespaceSelector, no ipBlock)
        assert rule["from"] == [{"podSelector": {"matchLabels": source} if source else {}}]
        assert rule["ports"] == [{"port": port}]
        assert objects[("NetworkPolicy", name)]["metadata"]["namespace"] == namespace


def test_in_a_profile_namespace_mlflow_stays_out_of_the_mesh(rendered):
    """Kubeflow's pipeline pods have no Istio sidecar; a profile's policy admits only mesh
    identities to sidecar-injected workloads, so MLflow and its database are not injected
    there (and nothing else changes: the stand-alone overlay has no mesh)."""
    overlay, objects = rendered
    for kind, name in (("Deployment", "mlflow"), ("StatefulSet", "mlflow-db")):
        template = objects[(kind, name)]["spec"]["template"]["metadata"]
        annotations = template.get("annotations", {})
        if overlay == "kubeflow":
            assert annotations == {"sidecar.istio.io/inject": "false"}
            assert template["labels"]["app.kubernetes.io/name"] == name  # labels kept
        else:
            assert "sidecar.istio.io/inject" not in annotations


# ---- SeaweedFS: configured before it serves ------------------------------------------------

def test_seaweedfs_starts_with_its_identity_and_never_anonymous(tmp_path):
    """Run the container's start script with a stand-in `weed` that records what it was given:
    the S3 config is written before the server starts, holds exactly the Secret's identity, and
    the server is told to use it; nothing runs after start (no postStart hook)."""
    objects, values = render_overlay(tmp_path, "standalone")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and
                     o["metadata"]["name"] == "shardrl-s3"]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "lifecycle" not in c
    assert c["command"] == ["/bin/sh", "-ec"]
    env = {v["name"]: v for v in c["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "shardrl-s3", "key": key}
    config_dir = env["S3_CONFIG"]["value"].rsplit("/", 1)[0]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == config_dir]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"  # the keys never reach a disk

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "weed-call.json"
    (bin_dir / "weed").write_text(
        "#!/bin/sh\n"
        f"python3 -c 'import json, sys; json.dump(sys.argv[1:], open(\"{record}\", \"w\"))' \"$@\"\n")
    (bin_dir / "weed").chmod(0o755)
    config = tmp_path / "s3.json"
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "S3_CONFIG": str(config),
               "AWS_ACCESS_KEY_ID": values["AWS_ACCESS_KEY_ID"],
               "AWS_SECRET_ACCESS_KEY": values["AWS_SECRET_ACCESS_KEY"]}
    subprocess.run([*c["command"], *c["args"]], env=run_env, check=True, timeout=30)
    argv = json.loads(record.read_text())
    assert argv[0] == "server" and "-s3" in argv and f"-s3.config={config}" in argv
    assert not any(values["AWS_SECRET_ACCESS_KEY"] in a for a in argv)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    (identity,) = json.loads(config.read_text())["identities"]
    assert identity["credentials"] == [{"accessKey": values["AWS_ACCESS_KEY_ID"],
                                        "secretKey": values["AWS_SECRET_ACCESS_KEY"]}]
    assert "Admin" in identity["actions"]


def test_the_local_seaweedfs_refuses_anonymous_requests(seaweed):
    """SeaweedFS started with an identities config (as the manifest and the tests start it)
    answers an unsigned request with 403."""
    import urllib.error
    import urllib.request

    for method, path in (("GET", "/"), ("PUT", "/anonymous-bucket")):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(seaweed.endpoint + path, method=method),
                                   timeout=10)
        assert info.value.code == 403, (method, path)
    assert not seaweed.client().bucket_exists("anonymous-bucket")
