"""One KFP container component per stage of the stage graph: interfaces only.

A component runs `graph.entrypoint(...)` (the same command line as the local runner) in the
stage's image; the stage's `main()` does the work. Its inputs are the run config (inline YAML,
a preset name or a path inside the image), the run id, the store URI and, for a replicated
stage, the replica index.
"""

# No `from __future__ import annotations`: KFP reads the inputs' types from real annotations.
from kfp import dsl
from kfp.dsl.base_component import BaseComponent

from shardrl.graph import entrypoint, stage

_ARGS_DOC = """
    Args:
        config: Run config: inline YAML, a preset name, or a path inside the image.
        run_id: Run id; everything of the run lives under {store}/runs/{run_id}/.
        store: Object store URI, e.g. s3://shardrl (credentials come from the environment)."""
_WORKER_DOC = """
        worker: Replica index, 0-based, out of the stage's replicas."""


def stage_component(name: str, image: str, *, workers: int = 1, once: bool = False,
                    ranks: int = 1, stages: tuple[str, ...] | None = None) -> BaseComponent:
    """The container component of stage `name` running in `image`.

    With `workers > 1` the component takes a `worker` input (the replica index) and passes
    `--worker/--workers` like the local runner; `once` adds `--once` (one synchronous round);
    `ranks > 1` starts the replica as that many processes under `torchrun`. A looping stage
    runs under `--supervise`, which restarts it inside its container when it crashes.
    `stages`, the pipeline's stages, are passed as `--stages`: a config pasted into a run
    that needs other stages is refused instead of waiting for shards no task writes.
    """
    spec = stage(name)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")

    if workers > 1:
        def component(config: str, run_id: str, store: str, worker: int) -> dsl.ContainerSpec:
            return dsl.ContainerSpec(image=image, command=entrypoint(
                name, config=config, run_id=run_id, store=store, worker=worker,
                workers=workers, once=once, ranks=ranks, supervise=spec.loops, stages=stages))
        args_doc = _ARGS_DOC + _WORKER_DOC
    else:
        def component(config: str, run_id: str, store: str) -> dsl.ContainerSpec:
            return dsl.ContainerSpec(image=image, command=entrypoint(
                name, config=config, run_id=run_id, store=store, once=once, ranks=ranks,
                supervise=spec.loops, stages=stages))
        args_doc = _ARGS_DOC

    mode = "one synchronous round" if once else ("until DONE.json" if spec.loops else "once")
    component.__name__ = f"shardrl_{name}" + ("_once" if once else "")
    component.__doc__ = f"ShardRL stage '{name}' ({mode}): {spec.description}.\n{args_doc}\n"
    return dsl.container_component(component)
