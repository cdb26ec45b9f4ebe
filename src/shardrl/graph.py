"""The stage graph, defined once and torch-free.

Every other view of the pipeline is derived from `STAGES`: the CLI's stage names, the order in
which the local runner starts stages, the stage whose cursor closes versions for a shard
reader (`upstream`), the stage that quarantines a shard kind (`consumer`), the images and
replicas of the Kubeflow tasks. A stage's variable parts (replicas, threads, ranks, image)
are config field paths and (field, value) rules held as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the graph imports nothing of the project: config and CLI derive from it
    from .config import RunConfig
    from .store.keys import ShardKind

Image = Literal["base", "vllm", "deepspeed"]


def field(cfg: RunConfig, path: str):
    """The config value at a dotted `path`, e.g. `rollout.workers`."""
    return reduce(getattr, path.split("."), cfg)


@dataclass(frozen=True)
class StageSpec:
    """One stage: how to start it, what it reads and writes, how it scales."""

    name: str
    module: str
    """Module with the stage's `main(ctx)`."""
    loops: bool
    """Runs until DONE.json (True) or once (False)."""
    after: tuple[str, ...]
    """Stages that must have finished before this one starts."""
    description: str
    cpu: str = "1"
    memory: str = "4Gi"
    """Default cluster resources of one replica (`pipeline.resources.<stage>` overrides)."""
    reads: ShardKind | None = None
    """The shard kind the stage consumes (and quarantines when unreadable)."""
    writes: ShardKind | None = None
    """The shard kind the stage produces, named after its input shard."""
    replicas_from: str | None = None
    """Config field with the number of parallel replicas (None: one)."""
    threads_from: str | None = None
    """Config field with the torch threads per replica on CPU (None: one)."""
    ranks_when: tuple[str, object, str] | None = None
    """(field, value, ranks field): processes per replica under torchrun when field == value."""
    image_when: tuple[tuple[str, object, Image], ...] = ()
    """(field, value, image) rules, first match wins; else the base image. A stage that builds
    a generation engine (`stages/engine.py`: rollout and evaluate) follows `rollout.engine`,
    so a vLLM run never starts one in an image without vLLM."""
    inline: bool = False
    """The rollout workers can run this stage inside their process (`rollout.postprocess`)."""

    def enabled(self, cfg: RunConfig) -> bool:
        """Whether the run has this stage as a process of its own."""
        return not (self.inline and cfg.inline_postprocess)

    def replicas(self, cfg: RunConfig) -> int:
        return int(field(cfg, self.replicas_from)) if self.replicas_from else 1

    def threads(self, cfg: RunConfig) -> int:
        return int(field(cfg, self.threads_from)) if self.threads_from else 1

    def ranks(self, cfg: RunConfig) -> int:
        """Processes of one replica: the learner's DeepSpeed ranks under torchrun, else 1."""
        if self.ranks_when is None:
            return 1
        when, value, ranks = self.ranks_when
        return int(field(cfg, ranks)) if field(cfg, when) == value else 1

    def image(self, cfg: RunConfig) -> Image:
        for when, value, image in self.image_when:
            if field(cfg, when) == value:
                return image
        return "base"


STAGES: tuple[StageSpec, ...] = (
    StageSpec("snapshot", "shardrl.stages.snapshot", False, (),
              "SFT warm start (model.sft); writes the frozen reference and policy v0, evaluates v0 "
              "(HF engine), writes run.json",
              cpu="2", memory="8Gi"),
    StageSpec("rollout", "shardrl.stages.rollout", True, ("snapshot",),
              "samples groups from the newest policy into rollout shards", cpu="2", memory="8Gi",
              writes="rollouts", replicas_from="rollout.workers", threads_from="rollout.threads",
              image_when=(("rollout.engine", "vllm", "vllm"),)),
    StageSpec("score", "shardrl.stages.score", True, ("snapshot",),
              "verifier / reward-model rewards and reference logprobs",
              reads="rollouts", writes="scored", threads_from="score.threads", inline=True),
    StageSpec("prepare", "shardrl.stages.prepare", True, ("snapshot",),
              "reward shaping, group advantages, zero-variance filtering, pass rates",
              memory="2Gi",
              reads="scored", writes="ready", inline=True),
    StageSpec("learn", "shardrl.stages.learn", True, ("snapshot",),
              "policy updates with bounded staleness; publishes versions; writes DONE.json",
              cpu="2", memory="8Gi",
              reads="ready", threads_from="learner.threads",
              ranks_when=("learner.backend.kind", "deepspeed", "learner.backend.ranks"),
              image_when=(("learner.backend.kind", "deepspeed", "deepspeed"),)),
    StageSpec("evaluate", "shardrl.stages.evaluate", True, ("snapshot",),
              "held-out pass@1 of published versions (v0 too with vLLM)",
              threads_from="eval.threads",
              image_when=(("rollout.engine", "vllm", "vllm"),)),
    StageSpec("promote", "shardrl.stages.promote", False, ("learn", "evaluate"),
              "registers the chosen checkpoint in the model registry and moves aliases",
              memory="2Gi"),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
LOOPING: tuple[str, ...] = tuple(s.name for s in STAGES if s.loops)
INLINE: tuple[str, ...] = tuple(s.name for s in STAGES if s.inline)
GENERATOR: str = next(s.name for s in STAGES if s.loops and s.reads is None and s.writes)
"""The stage whose replicas create the samples (the rollout workers)."""


def stage(name: str) -> StageSpec:
    """Look a stage up by name."""
    for spec in STAGES:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_NAMES)}")


def active(cfg: RunConfig) -> tuple[StageSpec, ...]:
    """The stages a run with `cfg` has as processes, in graph order."""
    return tuple(s for s in STAGES if s.enabled(cfg))


def before_loop(cfg: RunConfig) -> tuple[StageSpec, ...]:
    """One-shot stages the looping stages wait for (the snapshot)."""
    looping = {s.name for s in active(cfg) if s.loops}
    return tuple(s for s in active(cfg) if not s.loops and not looping & set(s.after))


def after_loop(cfg: RunConfig) -> tuple[StageSpec, ...]:
    """One-shot stages that wait for looping stages (promote)."""
    first = set(before_loop(cfg))
    return tuple(s for s in active(cfg) if not s.loops and s not in first)


def writer(kind: ShardKind) -> StageSpec:
    """The stage that produces shards of `kind`."""
    return next(s for s in STAGES if s.writes == kind)


def consumer(kind: ShardKind) -> StageSpec | None:
    """The stage that reads (and may quarantine) shards of `kind`, if any."""
    return next((s for s in STAGES if s.reads == kind), None)


def upstream(name: str, cfg: RunConfig) -> str | None:
    """The stage whose cursor closes versions for shard reader `name`: the stage writing what
    it reads, or None when that is the rollout workers (directly, or because they run the
    writer inline)."""
    spec = stage(name)
    if spec.reads is None:
        raise ValueError(f"stage '{name}' reads no shards")
    source = writer(spec.reads)
    return None if source.name == GENERATOR or not source.enabled(cfg) else source.name


def entrypoint(name: str, *, config: str, run_id: str, store: str | None = None,
               worker: int = 0, workers: int = 1, once: bool = False, ranks: int = 1,
               supervise: bool = False, stages: tuple[str, ...] | None = None) -> list[str]:
    """The command line that runs one replica of a stage (same in a pod and locally).

    With `ranks > 1` the replica is `ranks` processes on one node, started by `torchrun`.
    `supervise` restarts the stage inside its container when it crashes (`--supervise`; a
    pipeline's looping tasks); not under `torchrun`, whose ranks fail and restart together.
    `stages`: the stages a compiled pipeline has (`--stages`), which the stage checks against
    the run's config.
    """
    stage(name)
    launcher = ["shardrl"]
    if ranks > 1:
        launcher = ["torchrun", "--standalone", f"--nproc_per_node={ranks}", "-m", "shardrl.cli"]
    cmd = [*launcher, "stage", name, "--config", config, "--run-id", run_id]
    if store is not None:
        cmd += ["--store", store]
    if workers > 1 or stage(name).replicas_from:  # stated: the stage checks it (`stages.run`)
        cmd += ["--worker", str(worker), "--workers", str(workers)]
    if supervise and ranks == 1:
        cmd.append("--supervise")
    if once:
        cmd.append("--once")
    if stages is not None:
        cmd += ["--stages", ",".join(stages)]
    return cmd
