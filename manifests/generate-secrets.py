#!/usr/bin/env python3
"""Write the credential files an overlay's Secrets are generated from (kustomize
secretGenerator). They are ignored by git and never committed; without them
`kubectl kustomize` / `kubectl apply -k` stops with an error naming the missing file.

    python3 manifests/generate-secrets.py standalone   # or: make manifest-secrets OVERLAY=...
    python3 manifests/generate-secrets.py kubeflow     # needs AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY

Random passwords are generated for PostgreSQL, the MLflow admin user the stages log in as,
the MLflow server's session and CSRF key, and (standalone) the SeaweedFS S3 identity. The kubeflow overlay uses the object store of the
Kubeflow install, whose keys you pass in the environment (see the message when they are
missing). A file that exists is kept, so running again never changes a password that a
running database already holds; delete a file to generate it anew. Files are written
readable by their owner only. Standard library only: any python3 runs it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OVERLAYS = ("kubeflow", "standalone")
# credentials that ship with Kubeflow's and MinIO's examples: refused for the stores we create,
# reported (not refused) for Kubeflow's own store, which the install chose
KNOWN_DEFAULTS = frozenset({"minio", "minio123", "minioadmin", "admin", "password", "password1234",
                            "changeme", "change_me", "change_me_url_safe"})
KUBEFLOW_HINT = """\
the kubeflow overlay uses Kubeflow's object store: export its keys first, e.g.
  export AWS_ACCESS_KEY_ID="$(kubectl -n kubeflow get secret mlpipeline-minio-artifact \\
      -o jsonpath='{.data.accesskey}' | base64 -d)"
  export AWS_SECRET_ACCESS_KEY="$(kubectl -n kubeflow get secret mlpipeline-minio-artifact \\
      -o jsonpath='{.data.secretkey}' | base64 -d)"
"""


def token(nbytes: int = 24) -> str:
    """A random value safe in URLs, env files and JSON (hex)."""
    return secrets.token_hex(nbytes)


def write_env(path: Path, values: dict[str, str]) -> bool:
    """Write `KEY=value` lines to `path` (owner-only) unless it exists; True when written."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(f"{k}={v}\n" for k, v in values.items()))
    return True


def s3_values(overlay: str) -> dict[str, str]:
    if overlay == "standalone":  # the SeaweedFS of the overlay takes this identity at start
        return {"AWS_ACCESS_KEY_ID": "shardrl-" + token(4), "AWS_SECRET_ACCESS_KEY": token(20)}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise SystemExit(KUBEFLOW_HINT)
    if {key.lower(), secret.lower()} & KNOWN_DEFAULTS:
        print("warning: Kubeflow's object store uses its install's default credentials; "
              "change them in the Kubeflow install (Secret mlpipeline-minio-artifact)",
              file=sys.stderr)
    return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}


def generate(overlay: str, root: Path = ROOT) -> list[Path]:
    """Write the missing credential files of `overlay` under `root`; returns those written."""
    files = {
        root / "base/secrets/mlflow-db.env": lambda: {"POSTGRES_PASSWORD": token()},
        root / "base/secrets/mlflow-auth.env": lambda: {"MLFLOW_TRACKING_USERNAME": "shardrl",
                                                        "MLFLOW_TRACKING_PASSWORD": token()},
        root / "base/secrets/mlflow-server.env": lambda: {"MLFLOW_FLASK_SERVER_SECRET_KEY": token()},
        root / "overlays" / overlay / "secrets/s3.env": lambda: s3_values(overlay),
    }
    return [path for path, values in files.items()
            if not path.exists() and write_env(path, values())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overlay", choices=OVERLAYS)
    args = parser.parse_args(argv)
    written = generate(args.overlay)
    for path in written:
        print(f"wrote {path.relative_to(ROOT.parent)}")
    if not written:
        print(f"the credential files of {args.overlay} exist already; kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
