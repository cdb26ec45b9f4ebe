"""Registered policies: one model version per (pipeline run, policy version), in MLflow's
`transformers` flavor.

A version is logged as a text-generation pipeline (safetensors weights, the tokenizer, an
MLmodel file), so `mlflow.transformers.load_model("models:/NAME@champion")` returns a
pipeline and `mlflow.pyfunc.load_model` a model that generates from prompts. Each version
carries the tags of the run and policy version it came from; a retried promote finds it by
those tags and reuses it instead of registering a second copy.
"""

from __future__ import annotations

from pathlib import Path

RUN_TAG = "shardrl.run_id"
POLICY_VERSION_TAG = "shardrl.policy_version"
TASK = "text-generation"


def find_version(c, name: str, run_id: str, policy_version: int):
    """The registered version of `name` for this run's policy `policy_version`, or None
    (the oldest one if an earlier, interrupted promote registered more than one)."""
    # run ids are restricted to filter-safe characters (RunKeys); the model name is free
    # text, so it is compared here rather than quoted into the filter
    found = [mv for mv in c.search_model_versions(f"tags.`{RUN_TAG}` = '{run_id}'")
             if mv.name == name and mv.tags.get(POLICY_VERSION_TAG) == str(policy_version)]
    return min(found, key=lambda mv: int(mv.version)) if found else None


def requirements() -> list[str]:
    """What loading a logged policy needs: the versions it was written with."""
    import safetensors
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}",
            f"transformers=={transformers.__version__}",
            f"safetensors=={safetensors.__version__}"]


def log_policy(c, experiment_id: str, mlflow_run: str, folder: Path, name: str,
               tags: dict[str, str]):
    """Log the model folder `folder` (safetensors only) as MLflow model `name` of run
    `mlflow_run`; returns its `ModelInfo` (`model_uri`, `model_id`)."""
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import infer_signature

    from ..models.io import load_causal_lm, load_tokenizer

    # The logged model is created here, in the run's experiment, so its artifacts go where
    # the experiment's do (log_model alone would use the process's active experiment).
    logged = c.create_logged_model(experiment_id, name=name, source_run_id=mlflow_run,
                                   tags=tags)
    # an absolute path: the flavor looks the model up as a hub repository by this name,
    # and an absolute path fails that lookup at once, without going to the network
    folder = Path(folder).resolve()
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    card = ModelCard(f"---\nlicense: other\n---\n# {name}\n\nA ShardRL policy: "
                     + ", ".join(f"{k}={v}" for k, v in sorted(tags.items())) + "\n")
    signature = infer_signature(["prompt"], ["response"],
                                params={"max_new_tokens": 64, "do_sample": False})
    # Without run_id: given one, the flavor also copies every metric the run has at step 0
    # onto the model, which fails on the run's repeated points. The model records its run
    # (source_run_id above); the run lists it as an output here.
    info = mlflow.transformers.log_model(
        {"model": model, "tokenizer": tokenizer}, name=name, task=TASK, model_id=logged.model_id,
        model_card=card, signature=signature, pip_requirements=requirements(),
    )
    c.log_outputs(mlflow_run, models=[LoggedModelOutput(logged.model_id, step=0)])
    return info
