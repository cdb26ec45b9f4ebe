"""`shardrl pipeline compile|run`: the Kubeflow pipelines from the command line.

`run` submits to the Kubeflow Pipelines API at KFP_HOST; without KFP_HOST it says so and runs
the same stage graph locally with `shardrl run CONFIG`, so `make pipeline-run` works in any CI.
With `--require-cluster` (or REQUIRE_CLUSTER=1) a missing KFP_HOST is an error instead, so a CI
job that forgot it cannot pass without a cluster.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping

DEFAULT_COMPILE_CONFIG = "demo"
WAIT_TIMEOUT_S = 30 * 86400
"""Longest `--wait` (the largest stage timeout a config allows); a CI job's limit comes first."""
EXIT_WAIT_TIMED_OUT = 124
"""`--wait` gave up on a run that was created and still runs (as `timeout` exits)."""


def run(args: argparse.Namespace) -> int:
    """Dispatch `pipeline compile` / `pipeline run`."""
    from shardrl.config import ConfigError

    try:
        if args.action == "compile":
            return _compile(args)
        return _run(args, os.environ)
    except ConfigError as exc:  # a missing or invalid config: its errors, not a traceback
        print(exc, file=sys.stderr)
        return 1
    except ValueError as exc:
        if not _image_ref_error(exc):
            raise
        print(f"shardrl pipeline: {exc}", file=sys.stderr)  # --image-tag latest, say
        return 1
    except (FileExistsError, NotADirectoryError, PermissionError) as exc:  # the output folder
        print(f"shardrl pipeline: {exc}", file=sys.stderr)
        return 1


def _image_ref_error(exc: ValueError) -> bool:
    """Whether `exc` says an image reference cannot be made (`components.images`, which
    imports kfp: looked up only once an error came, so the local path needs no kfp)."""
    try:
        from components.images import ImageRefError
    except ImportError:
        return False
    return isinstance(exc, ImageRefError)


def _compile(args: argparse.Namespace) -> int:
    from pipelines.shardrl import compile_pipelines
    from shardrl.config import load_config

    cfg = load_config(getattr(args, "config", None) or DEFAULT_COMPILE_CONFIG)
    paths = compile_pipelines(cfg, args.out_dir, registry=args.image_registry,
                              tag=args.image_tag,
                              kubernetes_manifest_format=args.kubernetes_manifest_format)
    for path in paths.values():
        print(path)
    return 0


def _run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    host = env.get("KFP_HOST")
    if not host:
        if getattr(args, "require_cluster", False) or env.get("REQUIRE_CLUSTER") == "1":
            print("KFP_HOST is not set and a cluster is required (REQUIRE_CLUSTER=1): "
                  "nothing was submitted", file=sys.stderr)
            return 2
        if args.pipeline != "shardrl":  # the local runner runs the asynchronous pipeline only
            print(f"KFP_HOST is not set: --pipeline {args.pipeline} runs on a cluster only (the "
                  f"local runner runs the asynchronous pipeline, `--pipeline shardrl`); nothing "
                  f"was run", file=sys.stderr)
            return 2
        print("KFP_HOST is not set: running the pipeline locally with `shardrl run`, not on a "
              "cluster (set KFP_HOST to submit; REQUIRE_CLUSTER=1 fails instead)",
              file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "shardrl.cli", "run", args.config]
        return subprocess.run(cmd, check=False).returncode

    from pipelines.cluster import DEFAULT_STORE, SERVICE_ACCOUNT
    from pipelines.shardrl import compile_pipelines, config_text
    from pipelines.submit import SubmitError, submit
    from shardrl.config import load_config
    from shardrl.redact import redacted, without_userinfo
    from shardrl.store.keys import new_run_id

    cfg = load_config(args.config)
    if cfg.pipeline.ui_endpoint is None:  # the MLflow run links to the KFP run's page
        ui = without_userinfo((env.get("KF_PIPELINES_UI_ENDPOINT") or host).rstrip("/"))
        cfg = load_config(args.config, [f"pipeline.ui_endpoint={ui}"])
    text = config_text(cfg)
    # unique unless named: a lost answer is looked up by name, which must be this run's alone
    run_name = args.run_name or new_run_id(cfg.name)
    store = cfg.store.uri if cfg.store.uri.startswith("s3://") else DEFAULT_STORE
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipelines(cfg, tmp, config_default=text, names=(args.pipeline,),
                                    registry=getattr(args, "image_registry", None),
                                    tag=getattr(args, "image_tag", None))
        try:
            result = submit(
                package[args.pipeline], host=host, pipeline=args.pipeline,
                description=f"ShardRL pipeline '{args.pipeline}'", experiment=args.experiment,
                run_name=run_name, params={"config": text, "store": store}, env=env,
                service_account=env.get("KFP_SERVICE_ACCOUNT", SERVICE_ACCOUNT),
                wait_timeout_s=WAIT_TIMEOUT_S if args.wait else None,
                reuse_named=bool(args.run_name))
        except SubmitError as exc:
            print(f"shardrl pipeline run: {redacted(str(exc))}", file=sys.stderr)
            return 1
        except TimeoutError as exc:  # the run was created and goes on: a retry would start
            print(f"shardrl pipeline run: {exc}: stopped waiting; the run goes on (its link is "
                  f"above); `--run-name {run_name}` follows it again, where submitting without "
                  "it would start a second one", file=sys.stderr)
            return EXIT_WAIT_TIMED_OUT
    if result.found:
        print(f"run {result.run_id}: {result.found}: taken as this submission, not started "
              "again", file=sys.stderr)
    if result.state is None:  # (a run waited for was linked before the wait)
        print(f"run {result.run_id}: {result.url}")
        return 0
    print(f"run {result.run_id} finished: {result.state}")
    return 0 if result.state == "SUCCEEDED" else 1
