"""Where things live and run: store, tracking, orchestration, diagnosis thresholds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model, field_validator, model_validator

from ..graph import LOOPING, STAGE_NAMES, stage
from ..redact import has_userinfo
from .base import Section


class RetryConfig(Section):
    """Bounded exponential backoff for transient store failures."""

    max_attempts: int = Field(8, ge=1, le=1000)
    """Attempts per operation before the deadline check."""
    base_delay_s: float = Field(0.2, gt=0.0, le=60.0)
    """First backoff delay."""
    max_delay_s: float = Field(5.0, gt=0.0, le=600.0)
    """Largest backoff delay."""
    deadline_s: float = Field(120.0, gt=0.0, le=86400.0)
    """Give up (and fail the stage with a clear message) once an operation has been failing
    for this long, counted from its first failure (not from its start: a long upload cut
    late is retried)."""


STORE_CREDENTIALS = (
    "the store URI holds credentials (user:password@), which would be copied into run.json, "
    "logs and the pipelines' parameters: give s3://bucket/prefix alone and the credentials in "
    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (a Kubernetes secret in a cluster)")


class StoreConfig(Section):
    """Object store shared by all stages."""

    uri: str = Field("runs", min_length=1)
    """A folder path or file:// URI (local), or s3://bucket/prefix (credentials from the env)."""
    retry: RetryConfig = RetryConfig()
    """Retry policy for transient errors."""

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, uri: str) -> str:
        if has_userinfo(uri):  # the message must not repeat it
            raise ValueError(STORE_CREDENTIALS)
        return uri


class TrackingConfig(Section):
    """MLflow tracking and registry."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str = Field("sqlite:///mlflow.db", min_length=1)
    """Tracking URI; MLFLOW_TRACKING_URI in the environment wins. No credentials: the config
    is copied into run.json, logs and the pipelines' parameters."""
    experiment: str = Field("shardrl", min_length=1)
    """Experiment name."""

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, uri: str) -> str:
        if has_userinfo(uri):  # the message must not repeat it
            raise ValueError(
                "the tracking URI holds credentials (user:password@), which would be copied "
                "into run.json, logs and the pipelines' parameters: give the address alone and "
                "the credentials in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN), or a database URI in MLFLOW_TRACKING_URI")
        return uri


QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$"
"""A Kubernetes byte quantity, e.g. '8Gi'."""


class Resources(Section):
    """Kubernetes resources of one stage's pod."""

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _numbers_as_text(cls, value):
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    cpu: str = Field("1", pattern=r"^[0-9]+(\.[0-9]+)?m?$")
    """CPU request/limit, e.g. '2' or '500m'."""
    memory: str = Field("4Gi", pattern=QUANTITY)
    """Memory request/limit, e.g. '8Gi'."""
    gpus: int = Field(0, ge=0, le=64)
    """GPUs per pod."""
    gpu_type: str = "nvidia.com/gpu"
    """Accelerator resource name."""


class _StageResourcesBase(Section):
    """Resources per stage on the cluster; a partial entry keeps that stage's other defaults."""

    @model_validator(mode="before")
    @classmethod
    def _merge_stage_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        return {name: {**_defaults(name), **value} if isinstance(value, dict) and name in
                STAGE_NAMES else value for name, value in data.items()}


def _defaults(name: str) -> dict[str, str]:
    spec = stage(name)
    return {"cpu": spec.cpu, "memory": spec.memory}


StageResources = create_model(
    "StageResources", __base__=_StageResourcesBase,
    **{name: (Resources, Resources(**_defaults(name))) for name in STAGE_NAMES})
"""One `Resources` field per stage of the stage graph, with the graph's defaults."""


class LocalConfig(Section):
    """How the local runner places stage processes on this machine's cores."""

    fork: bool = True
    """Start stages by forking the runner, which imported their modules once, instead of a
    fresh interpreter each (saves every stage's torch and transformers import, seconds of CPU
    per stage). The learner's DeepSpeed ranks always start under torchrun."""
    weights_channel: bool = False
    """Hand each new policy version from the learner to the rollout workers through a folder
    in shared memory as the learner captures its commit, about 10 ms before the commit lands
    in the store (`stages.channel`; weights up to 64 MiB). The store stays the record."""
    share_cores: bool = False
    """Lend idle stages' cores to busy ones: a busy rollout, learner or evaluator runs on
    `cores // busy stages` threads (at least its configured `threads`)."""
    cores: dict[str, list[int] | None] = {}
    """Pin stages to CPU cores, e.g. `{rollout: [0], learn: [1]}`; unpinned stages may use
    every core. `rollout.N` places rollout worker N alone (`{rollout.0: [0], learn: [1]}`)
    and takes precedence over `rollout`; null removes an entry (a preset's, in a file that
    extends it). Pinning disables sharing for the pinned stages; cores outside the runner's cpuset
    (else the machine's online cores) are dropped with a warning, and a pin left with none is
    ignored."""
    nice: dict[str, int] = {"rollout": 5, "evaluate": 10}
    """Scheduling niceness of stages on shared cores (0-19; higher yields the CPU to lower).
    The learner makes the versions, so it goes first: while it is the bottleneck (the rollout
    workers ahead, at their backlog cap) the workers' generation, which it cannot use yet,
    and the evaluations would slow it if they had equal shares; niced, they run on the cycles
    it leaves, and once it waits for data they have the cores to themselves. `{}`: equal.
    `rollout.N` sets worker N's alone, as in `cores`. A dict given replaces this default
    whole: repeat the entries to keep."""

    @field_validator("nice")
    @classmethod
    def _nice_range(cls, value: dict[str, int]) -> dict[str, int]:
        for name, n in value.items():
            placed_worker(name, "nice")
            if not 0 <= n <= 19:
                raise ValueError(f"pipeline.local.nice.{name}: give a niceness from 0 to 19")
        return value

    @field_validator("cores")
    @classmethod
    def _known_cores(cls, value: dict[str, list[int] | None]) -> dict[str, list[int] | None]:
        for name, cpus in value.items():
            placed_worker(name, "cores")
            if cpus is not None and (not cpus or min(cpus) < 0):
                raise ValueError(f"pipeline.local.cores.{name}: give core numbers >= 0")
        return value

    def placed(self, setting: Literal["cores", "nice"], name: str, worker: int):
        """The `cores` or `nice` entry of replica `worker` of stage `name`: its own
        (`rollout.1`) unless null, else its stage's, else None."""
        entries = getattr(self, setting)
        own = entries.get(f"{name}.{worker}")
        return own if own is not None else entries.get(name)


def placed_worker(key: str, setting: str) -> int | None:
    """Check a `cores` or `nice` key, a looping stage or `rollout.N` for one worker; the
    worker N it names, or None for a whole stage."""
    name, dot, worker = key.partition(".")
    if name not in LOOPING or (dot and (name != "rollout" or not worker.isascii()
                                        or not worker.isdecimal()
                                        or worker != str(int(worker)))):
        raise ValueError(f"pipeline.local.{setting}.{key}: name a looping stage "
                         f"({', '.join(LOOPING)}) or one rollout worker, as rollout.0")
    return int(worker) if dot else None


class Toleration(Section):
    """One Kubernetes toleration of the GPU tasks' pods."""

    key: str | None = None
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    """Taint value (Equal only)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match (None: every effect)."""

    @model_validator(mode="after")
    def _value_with_equal(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.operator == "Equal" and self.key is None:
            raise ValueError("a toleration with operator Equal needs a key")
        return self


class PodConfig(Section):
    """What the Kubeflow tasks' pods get besides CPU, memory and GPUs (compiled in)."""

    shm_size: str = Field("2Gi", pattern=QUANTITY)
    """/dev/shm of GPU tasks: a memory-backed emptyDir of this size, since NCCL and vLLM need
    more than the container runtime's 64 MiB. Pages written there count against the pod's
    memory limit."""
    gpu_node_selector: dict[str, str] = {}
    """Node labels a GPU task's pod must match, e.g. `{cloud.google.com/gke-accelerator:
    nvidia-l4}`."""
    gpu_tolerations: list[Toleration] = [
        Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]
    """Tolerations of GPU tasks' pods (GPU node pools are usually tainted)."""
    image_pull_secrets: list[str] = []
    """Secrets (in the run's namespace) to pull the stage images with, for a private registry."""
    cache_size: str = Field("20Gi", pattern=QUANTITY)
    """Room for the model files a stage caches (a volume at its cache folder): an emptyDir of
    this size limit, or with `cache_storage_class` a generic ephemeral volume of this size,
    which is provisioned before the pod starts."""
    cache_storage_class: str | None = None
    """Storage class of the cache volume (None: an emptyDir on the node's disk)."""


class PipelineConfig(Section):
    """How the stages are run (local runner and Kubeflow)."""

    local: LocalConfig = LocalConfig()
    """Placement on one machine (local runner only)."""

    max_restarts: int = Field(3, ge=0, le=100)
    """Restarts of a crashed looping stage (local runner) / retries (Kubeflow)."""
    stage_timeout_s: int = Field(86400, ge=60, le=30 * 86400)
    """Wall-clock limit of one stage."""
    image_registry: str = "ghcr.io/shardrl"
    """Registry of the stage images (tags come from the package version)."""
    resources: StageResources = StageResources()
    """Per-stage resources on the cluster."""
    pod: PodConfig = PodConfig()
    """Shared memory, GPU node placement, pull secrets and the cache volume of the pods."""
    ui_endpoint: str | None = None
    """Base URL of the Kubeflow Pipelines UI, for the MLflow run's link to its KFP run
    (`shardrl pipeline run` fills it from KF_PIPELINES_UI_ENDPOINT or KFP_HOST, without
    their credentials). No credentials."""

    @field_validator("ui_endpoint")
    @classmethod
    def _link_without_credentials(cls, url: str | None) -> str | None:
        if url is not None and has_userinfo(url):
            raise ValueError("the UI address holds credentials (user:password@): a link "
                             "needs none, give the address alone")
        return url


class DoctorConfig(Section):
    """Thresholds of the training doctor."""

    kl_high: float = Field(10.0, gt=0.0)
    """kl_sum above this is a blow-up candidate."""
    kl_mean_high: float = Field(1.0, gt=0.0)
    """kl_mean (nats per token) above this is a blow-up candidate, whatever the length."""
    clip_frac_high: float = Field(0.3, gt=0.0, le=1.0)
    """Clip fraction above this is high."""
    kl_extreme: float = Field(10.0, gt=1.0)
    """A KL this many times its blow-up limit is a blow-up without a high clip fraction
    (with one update per batch only stale samples can be clipped, so the clip fraction
    follows the share of stale samples as much as the size of the step)."""
    kl_low: float = Field(1e-3, ge=0.0)
    """kl_mean within this of zero (either side: k1 can read negative) is 'stuck at zero'."""
    advantage_abs_max: float = Field(100.0, gt=0.0)
    """|advantage| above this is an explosion (ScaleRL alert)."""
    filter_rate_high: float = Field(0.5, gt=0.0, le=1.0)
    """Zero-variance filter rate above this is over-filtering."""
    truncation_rate_high: float = Field(0.1, gt=0.0, le=1.0)
    """Share of responses hitting max_new_tokens."""
    drift_high: float = Field(0.1, gt=0.0, le=100.0)
    """KL (k3, nats per token) from the sampling policy to the learner's on the same tokens
    above which the two have drifted apart (healthy demo runs peaked at 0.03-0.06)."""
    spike_factor: float = Field(5.0, gt=1.0)
    """A value this many times its running median is a spike."""
    window: int = Field(5, ge=2, le=10000)
    """Points per comparison window."""
    min_steps: int = Field(10, ge=2, le=1_000_000)
    """Steps of a series needed before a trend (rising, falling, flat) is judged."""
    entropy_drop: float = Field(0.2, gt=0.0, lt=1.0)
    """Entropy moves sharply (KL blow-up) when it is this fraction below or above its mean over
    the steps before."""
    reward_flat: float = Field(0.1, gt=0.0, le=100.0)
    """reward_rm is flat when its early-to-recent change is below this many reward stds."""
    reward_rise: float = Field(0.5, gt=0.0, le=100.0)
    """reward_rm is climbing when its early-to-recent change exceeds this many reward stds."""
    eval_drop: float = Field(0.05, gt=0.0, le=1.0)
    """Held-out pass@1 falls when its latest value is this far below its best (and, when the
    evaluations record standard errors, noise_z of the two's combined error below it)."""
    agreement_drop: float = Field(0.05, gt=0.0, le=1.0)
    """Verifier pass rate falls when its recent mean is this far below its early mean."""
    length_drift: float = Field(1.5, gt=1.0, le=100.0)
    """Response length drifts when its recent/early mean ratio leaves [1/x, x]."""
    shift_min: float = Field(0.5, gt=0.0, le=100.0)
    """A KL or length level shift must move the mean by this fraction of its level (collapse)."""
    reward_drop: float = Field(1.0, gt=0.0, le=100.0)
    """A sudden reward drop must lower the mean by this many reward stds (collapse): the
    within-batch std before the drop, or half the one after it if that is larger."""
    noise_z: float = Field(2.0, ge=0.0, le=100.0)
    """A change between two windows counts only beyond this many standard errors of their means."""
    fit_min_points: int = Field(6, ge=3, le=10000)
    """Held-out evaluations past the early phase needed before the compute->pass-rate
    sigmoid is fitted."""
    fit_skip_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Evaluations before this fraction of the run's learner tokens are left out of the fit
    (the early, transient phase, as ScaleRL does); the one at C = 0 still fixes R0."""
    fit_bootstrap: int = Field(200, ge=0, le=100_000)
    """Bootstrap resamples of the eval points for the fit's uncertainty (0: none)."""
