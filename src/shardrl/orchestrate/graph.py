"""The stage graph, defined once: the local runner and the Kubeflow pipeline both read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import RunConfig

Image = Literal["base", "vllm", "deepspeed"]


@dataclass(frozen=True)
class StageSpec:
    """One stage: how to start it, how many replicas, what it waits for."""

    name: str
    module: str
    """Module with the stage's `main(argv)`."""
    loops: bool
    """Runs until DONE.json (True) or once (False)."""
    after: tuple[str, ...]
    """Stages that must have finished before this one starts."""
    description: str

    def enabled(self, cfg: RunConfig) -> bool:
        """Whether the run has this stage: score and prepare run inside the rollout workers
        when `cfg.inline_postprocess` (see `rollout.postprocess`)."""
        return not (self.name in INLINE and cfg.inline_postprocess)

    def replicas(self, cfg: RunConfig) -> int:
        """Number of parallel workers of this stage."""
        return cfg.rollout.workers if self.name == "rollout" else 1

    def ranks(self, cfg: RunConfig) -> int:
        """Processes of one replica: the learner's DeepSpeed ranks under torchrun, else 1."""
        backend = cfg.learner.backend
        return backend.ranks if self.name == "learn" and backend.kind == "deepspeed" else 1

    def image(self, cfg: RunConfig) -> Image:
        """Which image runs this stage."""
        if self.name == "rollout" and cfg.rollout.engine == "vllm":
            return "vllm"
        if self.name == "learn" and cfg.learner.backend.kind == "deepspeed":
            return "deepspeed"
        return "base"

    def threads(self, cfg: RunConfig) -> int:
        """Torch threads per replica on CPU."""
        return {
            "rollout": cfg.rollout.threads,
            "score": cfg.score.threads,
            "learn": cfg.learner.threads,
            "evaluate": cfg.eval.threads,
        }.get(self.name, 1)


STAGES: tuple[StageSpec, ...] = (
    StageSpec("snapshot", "shardrl.stages.snapshot", False, (),
              "SFT warm start; writes the frozen reference, policy v0 and run.json"),
    StageSpec("rollout", "shardrl.stages.rollout", True, ("snapshot",),
              "samples groups from the newest policy into rollout shards"),
    StageSpec("score", "shardrl.stages.score", True, ("snapshot",),
              "verifier / reward-model rewards and reference logprobs"),
    StageSpec("prepare", "shardrl.stages.prepare", True, ("snapshot",),
              "reward shaping, group advantages, zero-variance filtering, pass rates"),
    StageSpec("learn", "shardrl.stages.learn", True, ("snapshot",),
              "policy updates with bounded staleness; publishes versions; writes DONE.json"),
    StageSpec("evaluate", "shardrl.stages.evaluate", True, ("snapshot",),
              "held-out pass@1 of published versions"),
    StageSpec("promote", "shardrl.stages.promote", False, ("learn", "evaluate"),
              "registers the chosen checkpoint in the model registry and moves aliases"),
)

INLINE = ("score", "prepare")
"""Stages the rollout workers can run inline (`rollout.postprocess`)."""

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
LOOPING: tuple[str, ...] = tuple(s.name for s in STAGES if s.loops)


def active(cfg: RunConfig) -> tuple[StageSpec, ...]:
    """The stages a run with `cfg` has, in graph order."""
    return tuple(s for s in STAGES if s.enabled(cfg))


def stage(name: str) -> StageSpec:
    """Look a stage up by name."""
    for spec in STAGES:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_NAMES)}")


def entrypoint(name: str, *, config: str, run_id: str, store: str | None = None,
               worker: int = 0, workers: int = 1, once: bool = False, ranks: int = 1) -> list[str]:
    """The command line that runs one replica of a stage (same in a pod and locally).

    With `ranks > 1` the replica is `ranks` processes on one node, started by `torchrun`.
    """
    stage(name)
    launcher = ["shardrl"]
    if ranks > 1:
        launcher = ["torchrun", "--standalone", f"--nproc_per_node={ranks}", "-m", "shardrl.cli"]
    cmd = [*launcher, "stage", name, "--config", config, "--run-id", run_id]
    if store is not None:
        cmd += ["--store", store]
    if workers > 1:
        cmd += ["--worker", str(worker), "--workers", str(workers)]
    if once:
        cmd.append("--once")
    return cmd
