"""KFP container components of the pipelines' own tasks: `monitor` and `report`
(`shardrl.orchestrate.kfp_tasks`). They run in the base image."""

# No `from __future__ import annotations`: KFP reads the inputs' types from real annotations.
from kfp import dsl
from kfp.dsl.base_component import BaseComponent

TASKS_MODULE = "shardrl.orchestrate.kfp_tasks"


def monitor_component(image: str) -> BaseComponent:
    """Forwards the stages' metrics to MLflow until DONE.json."""

    def shardrl_monitor(config: str, run_id: str, store: str) -> dsl.ContainerSpec:
        """ShardRL monitor: forwards the stages' metrics to MLflow while the run goes."""
        return dsl.ContainerSpec(image=image, command=[
            "python", "-m", TASKS_MODULE, "monitor", "--config", config, "--run-id", run_id,
            "--store", store])

    return dsl.container_component(shardrl_monitor)


def report_component(image: str) -> BaseComponent:
    """The closing summary, the MLflow <-> KFP links, and the Metrics and HTML artifacts."""

    def shardrl_report(config: str, run_id: str, store: str, metrics: dsl.Output[dsl.Metrics],
                       report: dsl.Output[dsl.HTML]) -> dsl.ContainerSpec:
        """ShardRL report: final pass@1, steps and the accounting as KFP Metrics, the run's
        summary as HTML, and the links between the MLflow run and the KFP run."""
        return dsl.ContainerSpec(image=image, command=[
            "python", "-m", TASKS_MODULE, "report", "--config", config, "--run-id", run_id,
            "--store", store, "--executor-input", dsl.PIPELINE_TASK_EXECUTOR_INPUT_PLACEHOLDER,
            "--metrics", metrics.path, "--html", report.path])

    return dsl.container_component(shardrl_report)
