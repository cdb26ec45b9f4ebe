"""Image names, defined once; tags carry the package version and the source revision.

A build is tagged `VERSION-gREV` (REV: the git commit, and `-dirty.HASH` with changes not
committed, HASH of those changes), so a rebuild never replaces another revision's image; the
plain `VERSION` tag is the release, pushed
once from a clean tree and never overwritten. Pipelines compiled from a checkout refer to the
`VERSION-gREV` images of that checkout; inside an image the revision comes from
`SHARDRL_GIT_REVISION`, set at build time. Never `:latest`.

`python -m components [--registry R] [--tag T]` prints `REF DOCKERFILE RELEASE` lines for
`make images` (RELEASE: the release ref to push if it does not exist yet, or `-`);
`python -m components --revision` prints the revision.
"""

import argparse
import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardrl import __version__
from shardrl.config.infra import PipelineConfig
from shardrl.graph import Image


@dataclass(frozen=True)
class ImageSpec:
    """One image: its repository name and the Dockerfile that builds it."""

    name: str
    dockerfile: str
    """Path relative to the repository root (the build context)."""


STAGE_IMAGES: dict[Image, ImageSpec] = {
    "base": ImageSpec("shardrl", "images/base.Dockerfile"),
    "vllm": ImageSpec("shardrl-rollout-vllm", "images/rollout-vllm.Dockerfile"),
    "deepspeed": ImageSpec("shardrl-learner-deepspeed", "images/learner-deepspeed.Dockerfile"),
}
"""Images that run stages, keyed by `StageSpec.image(cfg)`."""

SERVICE_IMAGES: dict[str, ImageSpec] = {
    "mlflow": ImageSpec("shardrl-mlflow", "images/mlflow.Dockerfile"),
}
"""Images of the cluster services in `manifests/`."""


ROOT = Path(__file__).resolve().parents[1]
REVISION_ENV = "SHARDRL_GIT_REVISION"
"""The source revision baked into the images (`--build-arg SHARDRL_GIT_REVISION=...`)."""


BUILD_CONTEXT = ("pyproject.toml", "README.md", "src", "components", "pipelines",
                 "images/requirements.py")
"""What the images copy from the checkout (`.dockerignore` admits these alone)."""


def revision(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str | None:
    """The source revision: `SHARDRL_GIT_REVISION`, else the checkout's short commit id, with
    `-dirty.HASH` when what the images are built from differs from it: a tracked file of
    `BUILD_CONTEXT` or `images/` changed, or an untracked one (not ignored) in
    `BUILD_CONTEXT`. HASH is of those differences, so two dirty builds share a tag only when
    they hold the same files, and a change elsewhere (a config, a test) keeps the tag of the
    images already built. None outside a checkout."""
    env = os.environ if env is None else env
    if env.get(REVISION_ENV):
        return env[REVISION_ENV]

    root = cwd or ROOT

    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").decode().strip()
        # what the images are built from: their context, and the Dockerfiles beside it
        changed = git("diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--",
                      *BUILD_CONTEXT, "images")
        untracked = sorted(git("ls-files", "--others", "--exclude-standard", "-z", "--",
                               *BUILD_CONTEXT).split(b"\0")[:-1])
        digest = hashlib.sha256(changed)
        for name in untracked:
            digest.update(b"\0" + name + b"\0" + (root / name.decode()).read_bytes())
    except (OSError, subprocess.CalledProcessError):
        return None
    if not head:
        return None
    return f"{head}-dirty.{digest.hexdigest()[:8]}" if changed or untracked else head


def is_dirty(rev: str) -> bool:
    """Whether a revision from `revision` is of a tree that differs from its commit."""
    return "-dirty" in rev


def build_tag(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
    """`VERSION-gREV`, or the release tag `VERSION` when the revision is unknown."""
    rev = revision(env, cwd)
    return f"{__version__}-g{rev}" if rev else __version__


class ImageRefError(ValueError):
    """An image registry or tag that cannot name a reproducible image."""


def image_ref(spec: ImageSpec, registry: str, tag: str | None = None) -> str:
    """`registry/name:tag`, the tag defaulting to the release tag (the package version)."""
    tag = tag or __version__
    if tag == "latest":
        raise ImageRefError("image tag 'latest' is not reproducible: use the package version")
    if not registry.strip("/"):
        raise ImageRefError("image registry must not be empty, e.g. ghcr.io/shardrl")
    return f"{registry.rstrip('/')}/{spec.name}:{tag}"


def main(argv: list[str] | None = None) -> int:
    """Print `REF DOCKERFILE RELEASE` for every image (stage images first)."""
    parser = argparse.ArgumentParser(prog="python -m components")
    parser.add_argument("--registry", default=PipelineConfig().image_registry,
                        help="default: the config's pipeline.image_registry default")
    parser.add_argument("--tag", default=None, help="default: VERSION-gREV of this checkout")
    parser.add_argument("--revision", action="store_true", help="print the revision and exit")
    args = parser.parse_args(argv)
    rev = revision()
    if args.revision:
        print(rev or "")
        return 0
    if args.tag is None and rev is None:
        print("cannot tell the source revision (not a git checkout, SHARDRL_GIT_REVISION "
              "unset): pass --tag (IMAGE_TAG=...) rather than overwrite the release tag",
              file=sys.stderr)
        return 2
    tag = args.tag or build_tag()
    clean = args.tag is None and not is_dirty(rev)
    for spec in (*STAGE_IMAGES.values(), *SERVICE_IMAGES.values()):
        release = image_ref(spec, args.registry) if clean else "-"
        print(image_ref(spec, args.registry, tag), spec.dockerfile, release)
    return 0
