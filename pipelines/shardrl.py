"""The ShardRL Kubeflow pipelines, built from the one stage graph.

- `shardrl`: snapshot -> concurrently rollout workers (a ParallelFor when there is more than
  one), score, prepare, learn, evaluate -> promote after learn and evaluate. The looping stages
  end by themselves on DONE.json.
- `shardrl-sync`: snapshot -> rounds, one after another (ParallelFor with parallelism 1), of
  rollout -> score -> prepare -> learn -> evaluate, each `--once` -> promote. For clusters that
  forbid long-running pods.

The pipelines' shape (replicas, images, resources, retries, timeout, number of rounds) is fixed
at compile time from a run config; the `config` parameter (the config pasted as YAML, a preset
name or a path in the image) drives everything else in the stages. Credentials come from
Kubernetes Secrets (`pipelines.cluster`), never from parameters.

Run as a script to compile: `python -m pipelines.shardrl [CONFIG] --out-dir build/pipelines`.
"""

# No `from __future__ import annotations`: KFP reads the parameters' types from annotations.
import argparse
import hashlib
import sys
from pathlib import Path

from kfp import compiler, dsl, kubernetes
from kfp.compiler.compiler_utils import KubernetesManifestOptions
from kfp.dsl.base_component import BaseComponent

from components import STAGE_IMAGES, build_tag, image_ref, stage_component
from components.images import ImageRefError
from components.tasks import monitor_component, report_component
from shardrl.config import ConfigError, RunConfig, load_config
from shardrl.config.infra import Resources
from shardrl.config.loader import dump_yaml
from shardrl.graph import StageSpec, active, after_loop, before_loop

from .cluster import DEFAULT_STORE, STAGE_SECRETS, TRACKING_SECRETS, TRACKING_TASKS

PIPELINE_NAMES: tuple[str, ...] = ("shardrl", "shardrl-sync")
RETRY_DELAY_S = 30
RETRY_FACTOR = 2.0
"""Backoff of a failed task's retries: first delay, growth factor."""
MAX_DURATION_S = 315_576_000_000
"""The largest protobuf Duration (10,000 years)."""
CACHE_DIR = "/home/shardrl/.cache/shardrl"
"""Where a task's cache volume is mounted: the stages' default cache folder in the images
(`$HOME/.cache/shardrl`, HOME=/home/shardrl)."""

_DESCRIPTIONS = {
    "shardrl": "Asynchronous RL fine-tuning: snapshot, then rollout workers, score, prepare, "
               "learn and evaluate run concurrently until the learner writes DONE.json; "
               "promote registers the chosen checkpoint in MLflow.",
    "shardrl-sync": "Synchronous RL fine-tuning in rounds of short pods (rollout, score, "
                    "prepare, learn, evaluate, each once per round), then promote.",
}
_PARAM_DOCS = {
    "config": "The run config: paste the YAML of a config (the default is the config the "
              "pipeline was compiled from), or give a preset name (demo, scalerl, ppo-rlhf) or "
              "a path inside the image. Workers, resources, images and the stages are fixed at "
              "compile time: a config that needs other stages or workers is refused.",
    "store": "Object store URI; the run's shards and checkpoints go under "
             "{store}/runs/{run id}/. Credentials and endpoint come from the shardrl-s3 Secret.",
}
_PARAMS_DOC = "Run ShardRL on Kubeflow.\n\nArgs:\n" + "".join(
    f"    {name}: {text}\n" for name, text in _PARAM_DOCS.items())


def config_text(cfg: RunConfig) -> str:
    """The resolved config as self-contained YAML: the default of the `config` parameter."""
    return dump_yaml(cfg.model_dump(mode="json"))


def sync_rounds(cfg: RunConfig) -> int:
    """Rounds of the sync pipeline: one learner step (one policy version) per round."""
    return cfg.learner.total_steps


def stage_image(spec: StageSpec, cfg: RunConfig, registry: str, tag: str | None = None) -> str:
    """The image reference that runs `spec` under `cfg` (`tag` defaults to `build_tag()`)."""
    return image_ref(STAGE_IMAGES[spec.image(cfg)], registry, tag or build_tag())


def retry_window_s(cfg: RunConfig) -> int:
    """The retry backoff's `maxDuration`: every attempt's full stage timeout plus every delay.

    Argo measures `maxDuration` from the first attempt's start (not from the failure), and on a
    retry it also cuts the new pod's deadline to what is left of it; the KFP backend passes
    `backoff_max_duration` through unchanged. A window shorter than the attempts themselves
    (kfp's default is an hour) means a stage that ran longer is never retried.
    """
    retries = cfg.pipeline.max_restarts
    delays = sum(int(RETRY_DELAY_S * RETRY_FACTOR ** i) for i in range(retries + 1))
    return min((retries + 1) * cfg.pipeline.stage_timeout_s + delays, MAX_DURATION_S)


def configure_pod(task: dsl.PipelineTask, gpus: int, cfg: RunConfig) -> dsl.PipelineTask:
    """Pull secrets and the model cache volume of every task; /dev/shm, node selector and
    tolerations of a GPU task (through kfp-kubernetes' platform config)."""
    pod = cfg.pipeline.pod
    if pod.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(pod.image_pull_secrets))
    # Model files go to a volume of their own, not the container's writable layer. The IR has
    # no ephemeral-storage request on the container: a generic ephemeral volume (with a
    # storage class) is reserved before the pod is scheduled; an emptyDir is bounded.
    if pod.cache_storage_class:
        kubernetes.add_ephemeral_volume(task, "shardrl-cache", CACHE_DIR, ["ReadWriteOnce"],
                                        pod.cache_size, storage_class_name=pod.cache_storage_class)
    else:
        kubernetes.empty_dir_mount(task, "shardrl-cache", CACHE_DIR, size_limit=pod.cache_size)
    if gpus > 0:
        kubernetes.empty_dir_mount(task, "dshm", "/dev/shm", medium="Memory",
                                   size_limit=pod.shm_size)
        for label, value in pod.gpu_node_selector.items():
            kubernetes.add_node_selector(task, label, value)
        for tol in pod.gpu_tolerations:
            kubernetes.add_toleration(task, key=tol.key, operator=tol.operator, value=tol.value,
                                      effect=tol.effect)
    return task


def configure_task(task: dsl.PipelineTask, spec: StageSpec, cfg: RunConfig) -> dsl.PipelineTask:
    """Resources, pod settings, retries, timeout, caching and secrets of one stage task."""
    return _configure(task, spec.name, getattr(cfg.pipeline.resources, spec.name), cfg)


def _configure(task: dsl.PipelineTask, name: str, res: Resources,
               cfg: RunConfig) -> dsl.PipelineTask:
    task.set_display_name(name)
    # Stages work on the store, not on KFP outputs: a cached task would skip real work.
    task.set_caching_options(enable_caching=False)
    task.set_cpu_request(res.cpu).set_cpu_limit(res.cpu)
    task.set_memory_request(res.memory).set_memory_limit(res.memory)
    if res.gpus > 0:
        task.set_accelerator_type(res.gpu_type).set_accelerator_limit(res.gpus)
    configure_pod(task, res.gpus, cfg)
    if cfg.pipeline.max_restarts > 0:
        # The KFP backend compiles this to Argo's retryStrategy without a retryPolicy, so
        # Argo's default applies (OnFailure): a main container that exits non-zero, is killed
        # (SIGTERM on preemption or a graceful node shutdown) or evicted is retried; a pod
        # deleted outright (its node removed) ends the node in Error, which is not. Restarts
        # of a crashed stage happen inside the pod (`--supervise`) and need no Argo retry.
        task.set_retry(num_retries=cfg.pipeline.max_restarts,
                       backoff_duration=f"{RETRY_DELAY_S}s", backoff_factor=RETRY_FACTOR,
                       backoff_max_duration=f"{retry_window_s(cfg)}s")
    # The pod's activeDeadlineSeconds: Kubernetes stops a stage that runs past its limit.
    kubernetes.set_timeout(task, cfg.pipeline.stage_timeout_s)
    for secret in STAGE_SECRETS + (TRACKING_SECRETS if name in TRACKING_TASKS else ()):
        kubernetes.use_secret_as_env(task, secret_name=secret.name,
                                     secret_key_to_env={k: k for k in secret.keys},
                                     optional=secret.optional)
    return task


def _add_stage(spec: StageSpec, cfg: RunConfig, registry: str, tag: str | None,
               params: dict, upstream: list[dsl.PipelineTask], once: bool) -> dsl.PipelineTask:
    """One stage's task, fanned out over a ParallelFor when it has several replicas."""
    replicas = spec.replicas(cfg)
    component = stage_component(spec.name, stage_image(spec, cfg, registry, tag),
                                workers=replicas, once=once, ranks=spec.ranks(cfg),
                                stages=tuple(s.name for s in active(cfg)))
    if replicas == 1:
        return configure_task(component(**params), spec, cfg).after(*upstream)
    with dsl.ParallelFor(items=list(range(replicas)), parallelism=replicas,
                         name=f"{spec.name}-workers") as worker:
        task = configure_task(component(**params, worker=worker), spec, cfg).after(*upstream)
    return task


TASK_RESOURCES = Resources(cpu="1", memory="2Gi")
"""Resources of the monitor and report tasks."""


def _add_monitor(cfg: RunConfig, registry: str, tag: str | None, params: dict,
                 upstream: list[dsl.PipelineTask]) -> dsl.PipelineTask:
    """Forwards the stages' metrics to MLflow while they run (ends on DONE.json)."""
    image = image_ref(STAGE_IMAGES["base"], registry, tag or build_tag())
    task = monitor_component(image)(**params)
    return _configure(task, "monitor", TASK_RESOURCES, cfg).after(*upstream)


def _add_report(cfg: RunConfig, registry: str, tag: str | None, params: dict,
                upstream: list[dsl.PipelineTask]) -> dsl.PipelineTask:
    """The final task: KFP Metrics and HTML artifacts, the MLflow <-> KFP links."""
    image = image_ref(STAGE_IMAGES["base"], registry, tag or build_tag())
    task = report_component(image)(**params)
    return _configure(task, "report", TASK_RESOURCES, cfg).after(*upstream)


def _async_body(cfg: RunConfig, registry: str, tag: str | None, params: dict) -> None:
    tasks: dict[str, dsl.PipelineTask] = {}
    for spec in active(cfg):
        upstream = [tasks[name] for name in spec.after]
        tasks[spec.name] = _add_stage(spec, cfg, registry, tag, params, upstream, once=False)
    monitor = _add_monitor(cfg, registry, tag, params,
                           [tasks[s.name] for s in before_loop(cfg)])
    # after every stage and the monitor: its final forward then sends the points the looping
    # stages logged after DONE.json (their last batch), once, and no forwarder runs beside it
    _add_report(cfg, registry, tag, params,
                [tasks[s.name] for s in after_loop(cfg)]
                + [tasks[s.name] for s in active(cfg) if s.loops] + [monitor])


def _sync_body(cfg: RunConfig, registry: str, tag: str | None, params: dict) -> None:
    """Stages before the loop, the looping stages chained in graph order per round, the rest."""
    stages = active(cfg)
    looping = [s for s in stages if s.loops]
    before = [s for s in stages if not s.loops and not any(a in {x.name for x in looping}
                                                          for a in s.after)]
    after = [s for s in stages if not s.loops and s not in before]
    tasks: dict[str, dsl.PipelineTask] = {}
    for spec in before:
        tasks[spec.name] = _add_stage(spec, cfg, registry, tag, params,
                                      [tasks[a] for a in spec.after], once=False)
    with dsl.ParallelFor(items=list(range(sync_rounds(cfg))), parallelism=1, name="rounds"):
        upstream = [tasks[a] for a in looping[0].after]
        for spec in looping:
            tasks[spec.name] = _add_stage(spec, cfg, registry, tag, params, upstream, once=True)
            upstream = [tasks[spec.name]]
    for spec in after:
        tasks[spec.name] = _add_stage(spec, cfg, registry, tag, params,
                                      [tasks[a] for a in spec.after], once=False)
    _add_report(cfg, registry, tag, params, [tasks[s.name] for s in after])


def build_pipeline(name: str, cfg: RunConfig, *, registry: str | None = None,
                   tag: str | None = None, config_default: str | None = None) -> BaseComponent:
    """The pipeline `name` (one of PIPELINE_NAMES) for `cfg`.

    `registry` defaults to `cfg.pipeline.image_registry`, `tag` to `VERSION-gREV` of this
    checkout (`components.build_tag`) and `config_default` (the `config` parameter's default)
    to the resolved config as YAML.
    """
    if name not in PIPELINE_NAMES:
        raise ValueError(f"unknown pipeline '{name}'; pipelines: {', '.join(PIPELINE_NAMES)}")
    registry = registry or cfg.pipeline.image_registry
    tag = tag or build_tag()
    body = _async_body if name == "shardrl" else _sync_body

    def pipeline(config: str = config_default or config_text(cfg),
                 store: str = DEFAULT_STORE) -> None:
        params = {"config": config, "run_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER, "store": store}
        body(cfg, registry, tag, params)

    pipeline.__doc__ = _PARAMS_DOC
    return dsl.pipeline(name=name, description=_DESCRIPTIONS[name])(pipeline)


def compile_pipelines(cfg: RunConfig, out_dir: str | Path, *, registry: str | None = None,
                      tag: str | None = None, config_default: str | None = None,
                      kubernetes_manifest_format: bool = False,
                      names: tuple[str, ...] = PIPELINE_NAMES) -> dict[str, Path]:
    """Compile pipelines to `out_dir/<name>.yaml` (IR); with `kubernetes_manifest_format`
    also `out_dir/<name>.k8s.yaml` (Pipeline and PipelineVersion resources)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = tag or build_tag()
    paths: dict[str, Path] = {}
    for name in names:
        func = build_pipeline(name, cfg, registry=registry, tag=tag,
                              config_default=config_default)
        paths[name] = out / f"{name}.yaml"
        compiler.Compiler().compile(func, str(paths[name]))
        _comment_out_default(paths[name], config_default or config_text(cfg))
        if kubernetes_manifest_format:
            # the package's content in the name too, as `pipeline run` names its versions:
            # two configs compiled at one tag are two versions, not one applied over the other
            digest = hashlib.sha256(paths[name].read_bytes()).hexdigest()[:12]
            version = f"{name}-v{tag.replace('.', '-')}-{digest}".lower()
            options = KubernetesManifestOptions(pipeline_version_name=version,
                                                include_pipeline_manifest=True)
            compiler.Compiler().compile(func, str(out / f"{name}.k8s.yaml"),
                                        kubernetes_manifest_format=True,
                                        kubernetes_manifest_options=options)
    return paths


def _comment_out_default(path: Path, default: str) -> None:
    """Keep the compiled YAML valid: KFP's header comment repeats a multi-line parameter
    default without `#` on its continuation lines (kubeflow/pipelines#10438)."""
    raw = f"[Default: '{default}']"
    text = path.read_text()
    if "\n" in default and raw in text:
        path.write_text(text.replace(raw, raw.replace("\n", "\n#      "), 1))


def main(argv: list[str] | None = None) -> int:
    """Compile both pipelines from a config (a file or preset name)."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.shardrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="demo", help="config file or preset name")
    parser.add_argument("--out-dir", default="build/pipelines")
    parser.add_argument("--kubernetes-manifest-format", action="store_true")
    parser.add_argument("--image-registry", default=None)
    parser.add_argument("--image-tag", default=None)
    args = parser.parse_args(argv)
    try:
        paths = compile_pipelines(load_config(args.config), args.out_dir,
                                  registry=args.image_registry, tag=args.image_tag,
                                  kubernetes_manifest_format=args.kubernetes_manifest_format)
    except ConfigError as exc:  # its errors, one per line: not a traceback
        print(exc, file=sys.stderr)
        return 1
    except ImageRefError as exc:
        print(f"python -m pipelines.shardrl: {exc}", file=sys.stderr)
        return 1
    for path in paths.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
