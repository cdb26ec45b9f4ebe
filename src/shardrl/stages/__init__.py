"""Stage entrypoints: `shardrl stage NAME ...` parses, then imports the stage and runs it."""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys

EXIT_STORE_UNAVAILABLE = 75
"""Exit status of a stage that waited `store.retry.deadline_s` for the object store in vain."""
EXIT_RUN_ABORTED = 3
"""Exit status of a stage that stopped the run itself: it wrote ABORTED.json with the reason,
and a restart would meet the same condition (the learner without signal to learn from)."""
EXIT_CONFIG = 2
"""A stage's config is invalid: no restart can fix it (the same status as a usage error)."""


class Stopped(SystemExit):
    """A stage asked to stop (SIGTERM: the runner ending the run, Kubernetes ending a pod)."""


def stop_on_sigterm() -> None:
    """SIGTERM raises `Stopped` (exit 143) in the main thread instead of ending the process
    where it stands: the stage's `finally` blocks run, so its buffered metrics and its queued
    shard writes reach the store. The stage's protocol survives a kill at any point, so an
    exception at any point is no worse. A second SIGTERM ends the process at once."""

    def stop(signum, frame):  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stopped(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def replicas_refused(args, cfg) -> str | None:
    """Why a replicated stage started as one of `--workers` replicas may not run with
    `cfg`, or None. The stages downstream would wait for replicas that never start: a
    Kubeflow pipeline fixes the replicas when it is compiled, and a config pasted into a run
    may ask for another number. Only a stated `--workers` is checked (a stage run by hand as
    one worker of several is a benchmark's)."""
    from ..graph import stage

    spec = stage(args.name)
    if not (spec.replicas_from and getattr(args, "workers_stated", False)):
        return None
    wanted = spec.replicas(cfg)
    if args.workers == wanted:
        return None
    return (f"started as one of {args.workers} replicas, but the run's config asks for "
            f"{wanted} ({spec.replicas_from}); a pipeline's replicas are fixed when it is "
            f"compiled: compile it from this config, or set {spec.replicas_from}: "
            f"{args.workers}")


def stages_refused(args, cfg) -> str | None:
    """Why a stage of a pipeline compiled with `--stages` may not run with `cfg`, or None. A
    config pasted into a Kubeflow run may need stages the pipeline has no task for (a
    `scalerl` config in a pipeline compiled from `demo`, whose rollout scores inline, has no
    score or prepare task): the learner would wait for ever for shards no task writes."""
    from ..graph import active

    compiled = getattr(args, "stages", None)
    if compiled is None:
        return None
    wanted = tuple(s.name for s in active(cfg))
    if tuple(compiled) == wanted:
        return None
    missing = [s for s in wanted if s not in compiled]
    extra = [s for s in compiled if s not in wanted]
    parts = ([f"needs {', '.join(missing)}, which the pipeline has no task for"] if missing
             else []) + ([f"has no use for {', '.join(extra)}"] if extra else [])
    return (f"the pipeline was compiled with the stages {', '.join(compiled)}, but the run's "
            f"config {' and '.join(parts) or 'orders them otherwise'} (for example through "
            "rollout.postprocess, a reward model or KL): compile the pipeline from this "
            "config, or paste a config with the same stages")


def launch_refused(args, cfg) -> str | None:
    """Why a stage started as part of a compiled pipeline may not run with `cfg`
    (`replicas_refused`, `stages_refused`), or None."""
    return replicas_refused(args, cfg) or stages_refused(args, cfg)


def run(args) -> int:
    threads = os.environ.get("SHARDRL_THREADS")
    from ..config import ConfigError
    from .context import build_context

    try:
        ctx = build_context(args)
    except ConfigError as exc:  # its errors, one per line, in the pod's log: no traceback
        print(f"shardrl stage {args.name}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    import torch

    from ..graph import stage

    if (refused := launch_refused(args, ctx.cfg)) is not None:
        print(f"shardrl stage {args.name}: {refused}", file=sys.stderr)
        return EXIT_CONFIG

    floor = int(threads) if threads else stage(args.name).threads(ctx.cfg)
    torch.set_num_threads(floor)
    from .cores import CoreShare

    ctx.cores = CoreShare.from_env(floor)
    torch.manual_seed(ctx.cfg.seed + 1000 * args.worker)
    module = importlib.import_module(f"shardrl.stages.{args.name}")
    from ..store import StoreUnavailable

    # the libraries' objects (a million or so) live as long as the process: keep them out of
    # the collector's full passes, each of which would otherwise pause a step or a shard
    gc.freeze()

    stop_on_sigterm()
    try:
        try:  # a looping stage waits for the run itself (`StageContext.wait_for_run`)
            return int(module.main(ctx) or 0)
        finally:
            if ctx.metrics is not None:
                ctx.metrics.flush()
            ctx.close()
    except StoreUnavailable as exc:
        ctx.log.error("giving up: %s", exc)
        return EXIT_STORE_UNAVAILABLE
    except ConfigError as exc:  # found only now (a model's modules, a folder): no restart
        reason = "invalid config: " + "; ".join(str(e) for e in exc.errors)
        ctx.log.error("%s", reason)
        if args.name != "snapshot":  # the run exists: every stage stops on the marker, also
            # when a launcher (torchrun) reports this rank's exit as another status
            import time

            from ..store import StoreError
            from ..store.records import Aborted

            try:
                Aborted(stage=args.name, worker=args.worker, exit_code=EXIT_CONFIG,
                        reason=reason[:1000], time=time.time()).write_first(
                    ctx.store, ctx.keys.aborted())
            except StoreError as store_exc:  # the exit status still says it
                ctx.log.warning("could not write the run's abort marker: %s", store_exc)
        return EXIT_CONFIG
