"""The contract between the pipeline and the cluster objects in `manifests/`.

Secret names and keys, the bucket, services and the service account are defined here once;
the manifests use the same literals and `tests/integration/test_manifests.py` checks that the
rendered objects agree with these values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SecretEnv:
    """Keys of one Kubernetes Secret exposed to every stage as environment variables.

    Each key is exposed under its own name (key `AWS_ACCESS_KEY_ID` -> env `AWS_ACCESS_KEY_ID`).
    """

    name: str
    keys: tuple[str, ...]
    optional: bool = False
    """The keys may be absent from the Secret (e.g. a tracking server without auth)."""


S3_SECRET = SecretEnv("shardrl-s3", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL"))
"""Object-store credentials and endpoint, read by `shardrl.store.s3`."""
MLFLOW_SECRET = SecretEnv("shardrl-mlflow", ("MLFLOW_TRACKING_URI",))
"""Tracking server address (wins over `tracking.uri` of the config)."""
MLFLOW_AUTH = SecretEnv("shardrl-mlflow", ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
                        optional=True)
"""Basic-auth credentials of the tracking server, when it has auth enabled."""
STAGE_SECRETS: tuple[SecretEnv, ...] = (S3_SECRET,)
"""What every task receives from Secrets; never from pipeline parameters."""
TRACKING_SECRETS: tuple[SecretEnv, ...] = (MLFLOW_SECRET, MLFLOW_AUTH)
"""What the tasks that talk to MLflow receive besides (`TRACKING_TASKS`): the other stages
write their metrics to the store, and their pods, which may run untrusted reward code, hold
no MLflow login."""
TRACKING_TASKS: tuple[str, ...] = ("promote", "monitor", "report")
"""The tasks that talk to MLflow: promote registers, monitor forwards the metrics, report
attaches its figures."""

BUCKET = "shardrl"
"""Bucket created by the bucket-init Job and used by the default store URI."""
DEFAULT_STORE = f"s3://{BUCKET}"
"""Default of the pipelines' `store` parameter: runs live under s3://shardrl/runs/<run id>/."""

MLFLOW_SERVICE = "mlflow"
MLFLOW_PORT = 5000
"""The tracking server's Service (standalone overlay): MLFLOW_TRACKING_URI=http://mlflow:5000."""
KUBEFLOW_S3_SERVICE = "minio-service.kubeflow"
KUBEFLOW_S3_PORT = 9000
"""Kubeflow's in-cluster object store (SeaweedFS or MinIO) behind its `minio-service`."""

SERVICE_ACCOUNT = "shardrl-pipeline-runner"
"""Service account the runs are submitted with (`pipeline run`; KFP_SERVICE_ACCOUNT overrides)."""
