"""Image names, defined once; tags come from the package version (never `:latest`).

`python -m components [--registry R] [--tag T]` prints `REF DOCKERFILE` lines for `make images`.
"""

import argparse
from dataclasses import dataclass

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


def image_ref(spec: ImageSpec, registry: str, tag: str | None = None) -> str:
    """`registry/name:tag`, the tag defaulting to the package version."""
    tag = tag or __version__
    if tag == "latest":
        raise ValueError("image tag 'latest' is not reproducible: use the package version")
    if not registry.strip("/"):
        raise ValueError("image registry must not be empty, e.g. ghcr.io/shardrl")
    return f"{registry.rstrip('/')}/{spec.name}:{tag}"


def main(argv: list[str] | None = None) -> int:
    """Print `REF DOCKERFILE` for every image (stage images first)."""
    parser = argparse.ArgumentParser(prog="python -m components")
    parser.add_argument("--registry", default=PipelineConfig().image_registry,
                        help="default: the config's pipeline.image_registry default")
    parser.add_argument("--tag", default=None, help="default: the package version")
    args = parser.parse_args(argv)
    for spec in (*STAGE_IMAGES.values(), *SERVICE_IMAGES.values()):
        print(image_ref(spec, args.registry, args.tag), spec.dockerfile)
    return 0
