"""Compile both pipelines, parse the IR strictly into KFP's protos and check every task."""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp import dsl
from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

from components import STAGE_IMAGES, build_tag, image_ref
from pipelines.cluster import DEFAULT_STORE, STAGE_SECRETS, TRACKING_SECRETS
from pipelines.shardrl import CACHE_DIR, compile_pipelines
from shardrl import __version__
from shardrl.commands import pipeline_cmd
from shardrl.config import load_config
from shardrl.graph import LOOPING, STAGE_NAMES, entrypoint, stage
from shardrl.stages.context import load_stage_config

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = "registry.example.com/team"
OVERRIDES = [
    "rollout.workers=3",
    "rollout.postprocess=stages",  # every stage its own task; the inline graph is tested below
    "learner.backend={kind: deepspeed}",
    "learner.total_steps=6",
    "eval.every=3",
    "pipeline.max_restarts=2",
    "pipeline.stage_timeout_s=7200",
    "pipeline.resources.rollout={cpu: '4', memory: 16Gi, gpus: 1}",
    "pipeline.resources.learn={cpu: '8', memory: 32Gi, gpus: 2, gpu_type: nvidia.com/gpu}",
    "pipeline.pod.shm_size=16Gi",
    "pipeline.pod.image_pull_secrets=[regcred]",
    "pipeline.pod.gpu_node_selector={pool: a100}",
]
GPU_STAGES = {"rollout", "learn"}
"""The stages OVERRIDES gives GPUs."""


def param(name: str) -> str:
    """KFP's placeholder for a component input parameter."""
    return f"{{{{$.inputs.parameters['{name}']}}}}"


@dataclass
class StageTask:
    """One compiled stage task with everything KFP and Kubernetes will run."""

    task: pb.PipelineTaskSpec
    container: pb.PipelineDeploymentConfig.PipelineContainerSpec
    k8s: k8s_pb.KubernetesExecutorConfig
    loops: list[pb.PipelineTaskSpec]
    """Enclosing ParallelFor tasks, outermost first."""
    siblings: dict[str, pb.PipelineTaskSpec]
    """Tasks of the same DAG (resolves dependentTasks)."""


def strict(data: dict, message):
    return json_format.ParseDict(data, message, ignore_unknown_fields=False)


def load_compiled(path: Path, stages_only: bool = True
                  ) -> tuple[pb.PipelineSpec, dict[str, StageTask]]:
    """Parse the IR YAML strictly and index its stage tasks (with `stages_only=False` also
    the monitor and report tasks) by display name."""
    spec_doc, platform_doc = yaml.safe_load_all(path.read_text())
    spec = strict(spec_doc, pb.PipelineSpec())
    platform = strict(platform_doc, pb.PlatformSpec())
    deployment = strict(json_format.MessageToDict(spec.deployment_spec),
                        pb.PipelineDeploymentConfig())
    k8s_execs = platform.platforms["kubernetes"].deployment_spec.executors
    tasks: dict[str, StageTask] = {}

    def walk(dag: pb.DagSpec, loops: list[pb.PipelineTaskSpec]) -> None:
        for task in dag.tasks.values():
            comp = spec.components[task.component_ref.name]
            if comp.WhichOneof("implementation") == "dag":
                walk(comp.dag, [*loops, task])
                continue
            k8s = strict(json_format.MessageToDict(k8s_execs[comp.executor_label]),
                         k8s_pb.KubernetesExecutorConfig())
            container = deployment.executors[comp.executor_label].container
            assert task.task_info.name not in tasks
            if stages_only and task.task_info.name not in STAGE_NAMES:
                continue
            tasks[task.task_info.name] = StageTask(task, container, k8s, loops, dict(dag.tasks))

    walk(spec.root.dag, [])
    return spec, tasks


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cfg = load_config("demo", OVERRIDES)
    paths = compile_pipelines(cfg, tmp_path_factory.mktemp("ir"), registry=REGISTRY)
    return cfg, {name: load_compiled(path) for name, path in paths.items()}


def test_every_stage_runs_its_graph_entrypoint_in_its_image(compiled):
    cfg, pipelines = compiled
    for name, (_, tasks) in pipelines.items():
        assert sorted(tasks) == sorted(STAGE_NAMES), name
        for stage_name, t in tasks.items():
            spec = stage(stage_name)
            expected = entrypoint(stage_name, config=param("config"), run_id=param("run_id"),
                                  store=param("store"), worker=param("worker"),
                                  workers=spec.replicas(cfg),
                                  once=name == "shardrl-sync" and spec.loops,
                                  supervise=spec.loops, stages=tuple(STAGE_NAMES))
            assert list(t.container.command) == expected, (name, stage_name)
            # every stage of this config, in the graph's order: a pasted config that needs
            # others is refused by the stage (`stages.stages_refused`)
            assert expected[-2:] == ["--stages", ",".join(STAGE_NAMES)]
            assert list(t.container.args) == []
            assert t.container.image == image_ref(STAGE_IMAGES[spec.image(cfg)], REGISTRY, build_tag())
            inputs = t.task.inputs.parameters
            assert inputs["run_id"].runtime_value.constant.string_value == \
                dsl.PIPELINE_JOB_ID_PLACEHOLDER
            assert inputs["config"].component_input_parameter in (
                "config", "pipelinechannel--config")


def test_multi_rank_learner_runs_under_torchrun(tmp_path):
    cfg = load_config("demo", [*OVERRIDES, "learner.backend.kind=deepspeed",
                               "learner.backend.ranks=2", "pipeline.resources.learn.gpus=2"])
    paths = compile_pipelines(cfg, tmp_path, registry=REGISTRY)
    _, tasks = load_compiled(paths["shardrl"])
    command = list(tasks["learn"].container.command)
    assert command[:6] == ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "shardrl.cli",
                           "stage"]
    assert tasks["learn"].container.image == image_ref(STAGE_IMAGES["deepspeed"], REGISTRY, build_tag())
    assert tasks["learn"].container.resources.accelerator.resource_count == "2"
    assert list(tasks["rollout"].container.command)[0] == "shardrl"
    # torchrun's ranks fail together: no in-pod supervisor under it, the KFP retry restarts them
    assert "--supervise" not in command and "--supervise" in tasks["rollout"].container.command


def builds_engine(module: str) -> bool:
    """Whether a stage module (or any module of a stage package) imports the generation
    engine of `stages/engine.py`, read from its source."""
    found = importlib.util.find_spec(module)
    origin = Path(found.origin)
    files = sorted(origin.parent.rglob("*.py")) if found.submodule_search_locations else [origin]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("engine") \
                    and any(a.name == "PolicyEngine" for a in node.names):
                return True
    return False


def test_vllm_config_runs_every_engine_stage_in_the_vllm_image(tmp_path):
    cfg = load_config("demo", ["rollout.engine=vllm", "rollout.postprocess=stages",
                               "pipeline.resources.rollout.gpus=1",
                               "pipeline.resources.evaluate.gpus=1"])
    paths = compile_pipelines(cfg, tmp_path, registry=REGISTRY)
    vllm_image = image_ref(STAGE_IMAGES["vllm"], REGISTRY, build_tag())
    needs_vllm = {name for name in STAGE_NAMES if builds_engine(stage(name).module)}
    assert needs_vllm == {"rollout", "evaluate"}
    for name, path in paths.items():
        tasks = load_compiled(path)[1]
        assert sorted(tasks) == sorted(STAGE_NAMES), name
        for stage_name, t in tasks.items():
            in_vllm = t.container.image == vllm_image
            assert in_vllm == (stage_name in needs_vllm), (name, stage_name, t.container.image)
    # with the hf engine no task runs in the vLLM image
    cfg = load_config("demo", ["rollout.postprocess=stages"])
    for path in compile_pipelines(cfg, tmp_path / "hf", registry=REGISTRY).values():
        assert all(t.container.image != vllm_image for t in load_compiled(path)[1].values())


def test_hand_written_commands_and_images(compiled):
    _, pipelines = compiled
    tasks = pipelines["shardrl"][1]
    # rollout: replica `worker` of 3 (from the loop item), base image (engine hf)
    assert list(tasks["rollout"].container.command) == [
        "shardrl", "stage", "rollout", "--config", param("config"), "--run-id", param("run_id"),
        "--store", param("store"), "--worker", param("worker"), "--workers", "3", "--supervise",
        "--stages", ",".join(STAGE_NAMES)]
    # images of this checkout's revision: VERSION-gREV
    tag = build_tag()
    assert tag.startswith(f"{__version__}-g") and tag != __version__
    assert tasks["rollout"].container.image == f"{REGISTRY}/shardrl:{tag}"
    # learn: DeepSpeed backend -> the DeepSpeed learner image
    assert tasks["learn"].container.image == f"{REGISTRY}/shardrl-learner-deepspeed:{tag}"
    sync = pipelines["shardrl-sync"][1]
    assert list(sync["learn"].container.command)[-4:-2] == ["--supervise", "--once"]
    # looping tasks restart their stage inside the pod; one-shot ones are retried by KFP only
    assert "--once" not in list(sync["promote"].container.command)
    assert "--supervise" not in list(sync["promote"].container.command)
    assert "--supervise" not in list(tasks["snapshot"].container.command)


def test_resources_retries_timeout_caching_and_secrets(compiled):
    cfg, pipelines = compiled
    expected_secrets = [(s.name, {k: k for k in s.keys}, s.optional) for s in STAGE_SECRETS]
    tracking = [(s.name, {k: k for k in s.keys}, s.optional) for s in TRACKING_SECRETS]
    assert expected_secrets[0] == ("shardrl-s3", {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                                                  "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
                                                  "S3_ENDPOINT_URL": "S3_ENDPOINT_URL"}, False)
    for _, tasks in pipelines.values():
        for stage_name, t in tasks.items():
            res = getattr(cfg.pipeline.resources, stage_name)
            r = t.container.resources
            assert (r.resource_cpu_request, r.resource_cpu_limit) == (res.cpu, res.cpu)
            assert (r.resource_memory_request, r.resource_memory_limit) == (res.memory, res.memory)
            if res.gpus:
                assert (r.accelerator.resource_type, r.accelerator.resource_count) == \
                    (res.gpu_type, str(res.gpus))
            else:
                assert not r.HasField("accelerator")
            assert t.task.caching_options.enable_cache is False
            retry = t.task.retry_policy
            assert retry.max_retry_count == 2
            # Argo counts maxDuration from the first attempt's start: it must hold three
            # attempts of the whole stage timeout (7200 s) and the delays 30 + 60 + 120 s.
            assert (retry.backoff_duration.seconds, retry.backoff_factor,
                    retry.backoff_max_duration.seconds) == (30, 2.0, 3 * 7200 + 210)
            assert t.k8s.active_deadline_seconds == 7200
            secrets = [(s.secret_name, {k.secret_key: k.env_var for k in s.key_to_env},
                        s.optional) for s in t.k8s.secret_as_env]
            # the MLflow login only where MLflow is used: a scoring pod that runs untrusted
            # code holds the store's keys, not the registry's
            assert secrets == expected_secrets + (tracking if stage_name == "promote" else [])
            assert ("MLFLOW_TRACKING_PASSWORD" in str(secrets)) == (stage_name == "promote")
    learn = pipelines["shardrl"][1]["learn"].container.resources
    assert (learn.resource_cpu_limit, learn.resource_memory_limit) == ("8", "32Gi")
    assert learn.accelerator.resource_count == "2"


def test_pods_get_shm_placement_pull_secrets_and_a_cache_volume(compiled):
    cfg, pipelines = compiled
    assert {n for n in STAGE_NAMES if getattr(cfg.pipeline.resources, n).gpus} == GPU_STAGES
    for _, tasks in pipelines.values():
        for stage_name, t in tasks.items():
            k8s = t.k8s
            assert [s.secret_name for s in k8s.image_pull_secret] == ["regcred"]
            mounts = {m.mount_path: m for m in k8s.empty_dir_mounts}
            cache = mounts.pop(CACHE_DIR)
            assert (cache.size_limit, cache.HasField("medium")) == ("20Gi", False)
            assert not k8s.generic_ephemeral_volume
            if stage_name in GPU_STAGES:
                shm = mounts.pop("/dev/shm")
                assert (shm.medium, shm.size_limit) == ("Memory", "16Gi")
                assert dict(k8s.node_selector.labels) == {"pool": "a100"}
                assert [(x.key, x.operator, x.effect) for x in k8s.tolerations] == [
                    ("nvidia.com/gpu", "Exists", "NoSchedule")]
            else:
                assert not k8s.HasField("node_selector") and not k8s.tolerations
            assert mounts == {}, stage_name


def test_cache_volume_with_a_storage_class_is_a_generic_ephemeral_volume(tmp_path):
    cfg = load_config("demo", ["pipeline.pod.cache_storage_class=fast-ssd",
                               "pipeline.pod.cache_size=50Gi"])
    _, tasks = load_compiled(compile_pipelines(cfg, tmp_path, registry=REGISTRY)["shardrl"])
    for t in tasks.values():
        (vol,) = t.k8s.generic_ephemeral_volume
        assert (vol.mount_path, vol.size, vol.storage_class_name, list(vol.access_modes)) == \
            (CACHE_DIR, "50Gi", "fast-ssd", ["ReadWriteOnce"])
        assert not t.k8s.empty_dir_mounts and not t.k8s.image_pull_secret


def test_cache_volume_sits_at_the_images_cache_folder():
    for spec in STAGE_IMAGES.values():
        env = (ROOT / spec.dockerfile).read_text()
        assert "HOME=/home/shardrl" in env, spec.dockerfile
    assert CACHE_DIR == "/home/shardrl/.cache/shardrl"  # StageContext.cache_dir()'s default


def test_monitor_forwards_metrics_and_report_emits_kfp_artifacts(compiled, tmp_path):
    cfg, _ = compiled
    paths = compile_pipelines(cfg, tmp_path, registry=REGISTRY)
    for name, path in paths.items():
        spec, tasks = load_compiled(path, stages_only=False)
        assert set(tasks) - set(STAGE_NAMES) == ({"monitor", "report"} if name == "shardrl"
                                                 else {"report"}), name
        report = tasks["report"]
        # the final task: after promote (and, in the asynchronous pipeline, after every
        # looping stage and the monitor: its final forward sends the points they logged after
        # DONE.json, with no other forwarder beside it), in the base image, writing a Metrics
        # and an HTML artifact; the metrics' values go to the executor output named in `{{$}}`
        assert _deps(report) == ({"promote", "monitor", "rollout-workers", "score", "prepare",
                                  "learn", "evaluate"} if name == "shardrl" else {"promote"})
        assert report.loops == []
        assert report.container.image == image_ref(STAGE_IMAGES["base"], REGISTRY, build_tag())
        assert list(report.container.command) == [
            "python", "-m", "shardrl.orchestrate.kfp_tasks", "report", "--config",
            param("config"), "--run-id", param("run_id"), "--store", param("store"),
            "--executor-input", "{{$}}", "--metrics", "{{$.outputs.artifacts['metrics'].path}}",
            "--html", "{{$.outputs.artifacts['report'].path}}"]
        outputs = spec.components[report.task.component_ref.name].output_definitions.artifacts
        assert {k: v.artifact_type.schema_title for k, v in outputs.items()} == {
            "metrics": "system.Metrics", "report": "system.HTML"}
        assert [s.secret_name for s in report.k8s.secret_as_env] == [
            s.name for s in STAGE_SECRETS + TRACKING_SECRETS]
        assert report.task.inputs.parameters["run_id"].runtime_value.constant.string_value == \
            dsl.PIPELINE_JOB_ID_PLACEHOLDER
    _, tasks = load_compiled(paths["shardrl"], stages_only=False)
    monitor = tasks["monitor"]
    # beside the looping stages from the snapshot on, until DONE.json
    assert _deps(monitor) == {"snapshot"}
    assert list(monitor.container.command)[:4] == [
        "python", "-m", "shardrl.orchestrate.kfp_tasks", "monitor"]
    assert [s.secret_name for s in monitor.k8s.secret_as_env] == [
        s.name for s in STAGE_SECRETS + TRACKING_SECRETS]


def _deps(t: StageTask) -> set[str]:
    return {t.siblings[d].task_info.name for d in t.task.dependent_tasks}


def test_async_graph_fans_out_rollout_workers(compiled):
    _, pipelines = compiled
    tasks = pipelines["shardrl"][1]
    (loop,) = tasks["rollout"].loops
    assert loop.iterator_policy.parallelism_limit == 3
    assert loop.parameter_iterator.items.raw == "[0, 1, 2]"
    assert tasks["rollout"].task.inputs.parameters["worker"].component_input_parameter == \
        loop.parameter_iterator.item_input
    assert list(loop.dependent_tasks) == ["shardrl-snapshot"]
    assert _deps(tasks["snapshot"]) == set()
    for name in ("score", "prepare", "learn", "evaluate"):
        assert tasks[name].loops == [] and _deps(tasks[name]) == {"snapshot"}
    assert _deps(tasks["promote"]) == {"learn", "evaluate"}


def test_sync_graph_runs_rounds_one_at_a_time(compiled):
    _, pipelines = compiled
    tasks = pipelines["shardrl-sync"][1]
    rounds, workers = tasks["rollout"].loops
    assert rounds.task_info.name == "rounds"
    assert rounds.iterator_policy.parallelism_limit == 1
    assert rounds.parameter_iterator.items.raw == "[0, 1, 2, 3, 4, 5]"  # learner.total_steps
    assert list(rounds.dependent_tasks) == ["shardrl-snapshot"]
    assert (workers.task_info.name, workers.iterator_policy.parallelism_limit) == \
        ("rollout-workers", 3)
    # Inside a round: rollout workers -> score -> prepare -> learn -> evaluate.
    assert [n for n in STAGE_NAMES if n in LOOPING] == \
        ["rollout", "score", "prepare", "learn", "evaluate"]
    assert _deps(tasks["score"]) == {"rollout-workers"}
    assert _deps(tasks["prepare"]) == {"score"}
    assert _deps(tasks["learn"]) == {"prepare"}
    assert _deps(tasks["evaluate"]) == {"learn"}
    for name in ("score", "prepare", "learn", "evaluate"):
        assert tasks[name].loops == [rounds]
    # promote waits for the whole loop of rounds
    assert tasks["promote"].loops == [] and _deps(tasks["promote"]) == {"rounds"}


def test_inline_postprocess_drops_score_and_prepare_from_both_graphs(tmp_path):
    cfg = load_config("demo", ["rollout.workers=2", "learner.total_steps=4", "eval.every=2"])
    assert cfg.inline_postprocess
    paths = compile_pipelines(cfg, tmp_path, registry=REGISTRY)
    for name, path in paths.items():
        _, tasks = load_compiled(path)
        assert sorted(tasks) == ["evaluate", "learn", "promote", "rollout", "snapshot"], name
    tasks = load_compiled(paths["shardrl-sync"])[1]
    # inside a round the learner waits for the rollout workers, which wrote the ready shards
    assert _deps(tasks["learn"]) == {"rollout-workers"}
    assert _deps(tasks["evaluate"]) == {"learn"}


def test_parameters_have_defaults_and_descriptions(compiled):
    cfg, pipelines = compiled
    for spec, _ in pipelines.values():
        params = spec.root.input_definitions.parameters
        assert sorted(params) == ["config", "store"]
        # The config default is the compiled config, self-contained: a stage reads it back
        # (inline YAML) as exactly that config.
        default = params["config"].default_value.string_value
        assert load_stage_config(default) == cfg
        assert params["store"].default_value.string_value == DEFAULT_STORE == "s3://shardrl"
        assert all(p.description and p.is_optional for p in params.values())


def test_cli_compiles_demo_with_kubernetes_manifests(tmp_path):
    args = argparse.Namespace(action="compile", out_dir=str(tmp_path),
                              kubernetes_manifest_format=True, image_registry=None,
                              image_tag="1.2.3")
    assert pipeline_cmd.run(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shardrl-sync.k8s.yaml", "shardrl-sync.yaml", "shardrl.k8s.yaml", "shardrl.yaml"]
    spec, tasks = load_compiled(tmp_path / "shardrl.yaml")
    # demo: two rollout workers -> a ParallelFor of 2, each with its --worker; the config's
    # registry; score and prepare run inside the workers
    (workers,) = tasks["rollout"].loops
    assert workers.iterator_policy.parallelism_limit == 2
    assert "--worker" in list(tasks["rollout"].container.command)
    assert tasks["rollout"].container.image == "ghcr.io/shardrl/shardrl:1.2.3"
    assert "score" not in tasks and "prepare" not in tasks
    pipeline, version = yaml.safe_load_all((tmp_path / "shardrl.k8s.yaml").read_text())
    assert (pipeline["kind"], version["kind"]) == ("Pipeline", "PipelineVersion")
    # the tag and the IR's content: another config compiled at this tag is another version
    digest = hashlib.sha256((tmp_path / "shardrl.yaml").read_bytes()).hexdigest()[:12]
    assert version["metadata"]["name"] == f"shardrl-v1-2-3-{digest}"
    assert strict(version["spec"]["pipelineSpec"], pb.PipelineSpec()) == spec
    strict(version["spec"]["platformSpec"], pb.PlatformSpec())


def test_make_pipeline_compile_uses_the_given_config(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("extends: demo\nname: mine\nrollout: {workers: 2}\n")
    out = tmp_path / "out"
    # -o: treat the venv stamp as up to date, so make does not reinstall the package
    proc = subprocess.run(["make", "-s", "-o", ".venv/.installed", "pipeline-compile",
                           f"CONFIG={config}", f"PIPELINE_DIR={out}", "IMAGE_REGISTRY=reg.test/x",
                           "K8S_MANIFEST=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SHARDRL_GIT_REVISION": "feed"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("*.yaml"))) == 4
    spec, tasks = load_compiled(out / "shardrl.yaml")
    assert tasks["rollout"].loops[0].iterator_policy.parallelism_limit == 2
    assert tasks["rollout"].container.image == f"reg.test/x/shardrl:{__version__}-gfeed"
    default = spec.root.input_definitions.parameters["config"].default_value.string_value
    assert yaml.safe_load(default)["name"] == "mine"
