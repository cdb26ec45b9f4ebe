"""The kustomize overlays rendered as a user renders them: a copy of `manifests/` whose
credential files `manifests/generate-secrets.py` wrote (they are never committed)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ("kubeflow", "standalone")


def copy_manifests(dest: Path) -> Path:
    """`manifests/` copied to `dest`, without any credential file of this checkout."""
    shutil.copytree(ROOT / "manifests", dest, ignore=shutil.ignore_patterns("secrets"))
    return dest


def generate(folder: Path, overlay: str) -> dict[str, str]:
    """Run the generator in `folder` as the README says; {file name: its KEY=value text}."""
    env = {"PATH": "/usr/bin:/bin"}
    if overlay == "kubeflow":  # the keys of the Kubeflow install's store, which it reads
        env |= {"AWS_ACCESS_KEY_ID": "kf-" + secrets.token_hex(4),
                "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20)}
    subprocess.run([sys.executable, str(folder / "generate-secrets.py"), overlay], env=env,
                   check=True, capture_output=True, text=True, timeout=60)
    files = [*(folder / "base/secrets").iterdir(), *(folder / "overlays" / overlay / "secrets").iterdir()]
    return {p.name: p.read_text() for p in files}


def kustomize(folder: Path, overlay: str) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(folder / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60)


def render(tmp: Path, overlay: str) -> tuple[list[dict], dict[str, str]]:
    """(the rendered objects, the generated credentials {KEY: value}) of `overlay`."""
    folder = copy_manifests(tmp / "manifests")
    files = generate(folder, overlay)
    res = kustomize(folder, overlay)
    assert res.returncode == 0, res.stderr
    values = dict(line.split("=", 1) for text in files.values() for line in text.splitlines())
    return [o for o in yaml.safe_load_all(res.stdout) if o], values
