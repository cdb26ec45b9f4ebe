"""Per-stage settings: rollout, prepare, learner, evaluation, promotion."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Section


class StandbyConfig(Section):
    """Rollout workers that generate only while the learner lacks data."""

    workers: int = Field(0, ge=0, le=1023)
    """How many of `rollout.workers` (the last ones, and never all: one worker always
    generates) stand by. The others split
    `learner.batch_prompts` between them and generate throughout; a standby worker helps
    with the learner's first batch, then pauses until the learner waits for data for `start`
    of its time over the last `window_steps` steps, and generates until that share falls
    under `stop`. Its backlog share is `batch_prompts / workers`. While the learner is the
    bottleneck the samples then come from the fewest workers, the freshest; once generation
    is, every core generates. 0: every worker generates throughout."""
    start: float = Field(0.5, gt=0.0, le=1.0)
    """Share of the learner's wall time waiting for data that calls the standby workers in."""
    stop: float = Field(0.1, ge=0.0, le=1.0)
    """Share under which they stand by again (at most `start`)."""
    window_steps: int = Field(8, ge=1, le=100_000)
    """Learner steps the share is measured over."""

    @model_validator(mode="after")
    def _stop_below_start(self) -> StandbyConfig:
        if self.stop > self.start:
            raise ValueError(f"rollout.standby.stop ({self.stop}) must not exceed "
                             f"rollout.standby.start ({self.start})")
        return self


class RolloutConfig(Section):
    """Generation of groups of samples by the current policy."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: transformers (CPU/GPU) or vLLM (GPU image)."""
    workers: int = Field(1, ge=1, le=1024)
    """Rollout replicas."""
    group_size: int = Field(8, ge=2, le=4096)
    """Samples per prompt (G)."""
    prompts_per_shard: int = Field(8, ge=1, le=65536)
    """Prompt groups per rollout shard."""
    temperature: float = Field(1.0, gt=0.0, le=4.0)
    """Sampling temperature (the learner uses the same one)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: 1 only (see `_full_distribution`); `temperature` sets exploration."""
    max_new_tokens: int = Field(16, ge=1, le=131072)
    """Response length limit; a response hitting it has finish_reason 'length'."""
    max_turns: int = Field(1, ge=1, le=1024)
    """Policy turns of an episode in `task.environment` (`max_new_tokens` each); the
    environment's reply follows each turn. 1 without an environment: single responses."""
    max_backlog_steps: int = Field(1, ge=0, le=100_000)
    """Flow control in the unit the learner consumes: a worker pauses while the prompt groups
    kept by filtering that it wrote and the learner has not yet committed fill this many
    learner steps beyond the one being trained (the worker's share of `batch_prompts` each).
    Never more than `max_staleness` steps, so `k: 0` stays synchronous. More run-ahead keeps
    the workers busier but trains on older samples: on the demo (2 cores, 5 seeds) 2 instead
    of 1 raised samples/s by 5% and the workers' busy share from 0.82 to 0.86, yet reached
    the target pass@1 later (0.65x the synchronous loop's speed instead of 1.26x)."""
    lead_counted_at: Literal["commit", "take"] = "commit"
    """When a worker's shards stop counting toward `max_backlog_steps`: once the learner's
    commit consumed them (`commit`), or once the learner took them into a step, before its
    update (`take`): then a worker generates the next step's share while the learner trains
    on its last, on samples one version fresher than under `commit` at the same run-ahead.
    `take` needs the exact kept counts of inline post-processing (`postprocess`) and
    `min(max_backlog_steps, k) >= 1`; otherwise `commit` applies."""
    standby: StandbyConfig = StandbyConfig()
    """Workers that generate only while the learner lacks data (see `StandbyConfig`)."""
    max_batch_shards: int = Field(8, ge=1, le=4096)
    """Most shards generated in one batch. A worker generates as many shards at once as its
    backlog has room for (fewer, larger batches keep the cores busy); 1: shard by shard."""
    postprocess: Literal["auto", "inline", "stages"] = "auto"
    """Where scoring and prepare run. `inline`: inside each rollout worker, which writes the
    ready shards the stages would (`inline_shards`; no extra processes, no hops); it
    needs verifier rewards without a reward model, no reference logprobs from a separate
    model (`algo.kl.placement: none`, or KL in the loss against the initial policy with
    `learner.lora`, whose learner computes them) and, with several workers, neither reward normalization nor No-Positive-Resampling
    (their statistics span all workers). `stages`: as the score and prepare stages. `auto`:
    inline when allowed and the verifiers are not sandboxed, else stages."""
    inline_shards: Literal["ready", "all"] = "ready"
    """With inline post-processing, what a worker writes per generated shard. `ready`: the
    ready shard alone, which holds every column of the rollout and scored shards: one store
    write instead of three (on the demo, 2 cores, 8 seeds paired: 14% less CPU per optimizer
    step, steps 1.14x as fast up to version 30 and 1.22x after). `all`: also the rollout
    and scored shards, as the score and prepare stages would write them (to keep each
    step's output apart, for instance). Readers (the learner, the
    accounting, reports) take a shard's rows from whichever of its shards exists."""
    poll_interval_s: float = Field(0.2, gt=0.0, le=600.0)
    """Longest wait between checks while paused (a commit by the learner wakes it sooner)."""
    threads: int = Field(1, ge=1, le=512)
    """Torch threads per rollout worker on CPU."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """vLLM only: share of GPU memory for weights and KV cache."""

    @model_validator(mode="after")
    def _full_distribution(self) -> RolloutConfig:
        if self.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p {self.top_p} < 1: the nucleus's renormalised probabilities, "
                "which the rollout records as the behaviour log-probabilities, are not the "
                "policy's that the learner trains (the full softmax at `temperature`): the "
                "importance ratio of an on-policy token would start at the nucleus's mass "
                "instead of 1 (PPO clips at 1 - eps_low, CISPO scales by it), and a KL "
                "penalty in the reward would gain -log(mass) per token. Keep top_p 1 and "
                "set exploration with rollout.temperature")
        return self


class PrepareConfig(Section):
    """Reward shaping, advantages and filtering of scored shards."""

    poll_interval_s: float = Field(0.2, gt=0.0, le=600.0)
    """Longest wait between listings when there is nothing to do (a commit wakes it sooner)."""


class ScoreConfig(Section):
    """Reward computation."""

    poll_interval_s: float = Field(0.2, gt=0.0, le=600.0)
    """Longest wait between listings when there is nothing to do (a commit wakes it sooner)."""
    threads: int = Field(1, ge=1, le=512)
    """Torch threads (reward model, reference logprobs)."""


class TorchBackend(Section):
    """Plain PyTorch learner (single process)."""

    kind: Literal["torch"] = "torch"


class DeepSpeedBackend(Section):
    """DeepSpeed ZeRO learner (CPU with gloo, or GPUs with torchrun)."""

    kind: Literal["deepspeed"] = "deepspeed"
    zero_stage: Literal[1, 2, 3] = 2
    """ZeRO partitioning stage."""
    offload_optimizer: bool = False
    """Keep optimizer state in CPU memory."""
    bf16: bool = False
    """bfloat16 training (GPU)."""
    ranks: int = Field(1, ge=1, le=1024)
    """Learner processes, started by `torchrun` (one per GPU on a GPU node)."""


LearnerBackend = Annotated[TorchBackend | DeepSpeedBackend, Field(discriminator="kind")]


class PublishConfig(Section):
    """How the learner publishes policy versions for rollout and evaluation."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the published weights, which rollout workers and evaluation load; `auto` is
    the generator's `model.dtype`. The learner trains float32 masters either way."""
    full_every: int = Field(10, ge=1, le=1_000_000)
    """Every version after v0 is published as a delta against v - 1 that holds only the
    tensors that changed (their changed elements alone when that is smaller); when
    v % full_every == 0 the full weights are written too (alone when a restarted learner
    lacks the state of v - 1), for a reader that starts late or lost its base. 1 writes
    every version in full as well."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA, with peft) trained in place of the policy's weights."""

    r: int = Field(8, ge=1, le=4096)
    """Rank of each adapter: A is (r, in), B is (out, r)."""
    alpha: float = Field(16.0, gt=0.0, le=1e6)
    """The adapter's output is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (masks drawn from a per-step seed, so a
    resumed or replayed step draws the same ones)."""
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, max_length=64)
    """Names (or name endings) of the linear layers to adapt, e.g. `q_proj`, `gate_proj`.
    The output head and the embeddings (tied in many models) cannot be adapted."""

    @model_validator(mode="after")
    def _linear_layers_only(self) -> LoraConfig:
        tied = sorted({m for m in self.target_modules if m.split(".")[-1] in UNADAPTABLE})
        if tied:
            raise ValueError(
                f"`learner.lora.target_modules` names {tied}: the output head and embeddings "
                "are often tied, and an adapter would untie them in the merged weights; "
                "adapt the transformer's linear layers (q_proj, k_proj, v_proj, o_proj, "
                "gate_proj, up_proj, down_proj)")
        return self


UNADAPTABLE = ("lm_head", "embed_tokens", "wte", "embed_out")
"""Module names LoRA may not target (output heads and embeddings)."""


class LearnerConfig(Section):
    """Policy updates from ready shards with bounded staleness."""

    backend: LearnerBackend = TorchBackend()
    """Training backend."""
    total_steps: int = Field(100, ge=1, le=100_000_000)
    """Optimizer steps; each publishes one policy version."""
    batch_prompts: int = Field(8, ge=1, le=65536)
    """Prompt groups per optimizer step (B)."""
    max_staleness: int = Field(8, ge=0, le=100_000)
    """k: admit a sample iff learner_version - policy_version <= k; 0 is synchronous."""
    halve_staleness_at: float | None = Field(None, gt=0.0, lt=1.0)
    """If set, k is halved once this fraction of total_steps is done (e.g. 0.8)."""
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    """AdamW beta2."""
    warmup_steps: int = Field(5, ge=0, le=10_000_000)
    """Linear warmup."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of lr."""
    grad_clip: float | None = Field(1.0, gt=0.0, le=1e6)
    """Global gradient-norm clip."""
    ckpt_every: int = Field(10, ge=1, le=10_000_000)
    """Resumable checkpoint every this many steps."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """Checkpoints kept."""
    threads: int = Field(1, ge=1, le=512)
    """Torch threads on CPU."""
    poll_interval_s: float = Field(0.1, gt=0.0, le=600.0)
    """Longest wait between listings while waiting for data (a commit wakes it sooner)."""
    doctor_every: int = Field(10, ge=1, le=1_000_000)
    """Run the live doctor every this many steps (where the commits' writes run: the
    `commit_writer` child process by default)."""
    max_batches_without_signal: int | None = Field(64, ge=1, le=1_000_000)
    """Once this many batches' worth of prompt groups (`batch_prompts` each) in a row had none
    kept by filtering (every group's rewards were all equal, so there is nothing to learn
    from): if every one of their samples was correct, the policy has converged and the run
    finishes at that version (DONE.json with `converged`; evaluate and promote go on);
    otherwise it stops with the diagnosis (ABORTED.json). The count is part of each commit,
    so a restarted learner goes on from it. None: keep going."""
    publish: PublishConfig = PublishConfig()
    """Published weights: dtype, deltas and full snapshots."""
    commit_writer: Literal["auto", "process", "thread"] = "auto"
    """Where a commit's weights delta and records are serialized and written, off the step's
    path either way: `process`, a child process forked when the learner starts (Linux; its
    own interpreter, so that Python work no longer slows the next update down; it keeps a
    copy of the last published weights); `thread`, the learner's writer thread; `auto`, the
    process while a published version is at most 64 MiB, the thread beyond."""
    micro_batch: int | None = Field(None, ge=1, le=1_000_000)
    """Samples per forward and backward pass: the gradients of a step's micro-batches add
    up to the gradient of the whole batch's loss (every aggregation normalizes over the
    whole batch), so the batch size no longer sets the activation memory. None: the whole
    batch at once. Plain torch backend and group-relative advantages only (validation
    rejects it with DeepSpeed or GAE)."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=1_000_000_000)
    """Padded tokens (rows x the longest row) per forward and backward pass, the rows
    sorted by length first so that each micro-batch pads its rows to nearly their own
    length; with `micro_batch` too, both bounds hold. The step is the whole batch's either
    way (as with `micro_batch`). Plain torch backend and group-relative advantages only
    (validation rejects it with DeepSpeed or GAE). None: no token bound.
    On the demo's model (one thread, rows of 6-16 tokens) a budget of 1536 trained a batch
    of 224 kept rows in about 17% less CPU time than one padded pass, and batches of 128-144
    rows in about the same time, so the demo leaves it off; it pays where row lengths vary
    more than the demo's."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight; published versions hold the merged
    weights. None: full fine-tuning. Plain torch backend only."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input through the forward pass and recompute the
    block in the backward pass (transformers' gradient checkpointing): the activations of
    a micro-batch shrink to one block's, for about one more forward pass of compute."""
    logits_chunk_mb: float | None = Field(256.0, gt=0.0, le=1e7)
    """Largest float32 logits tensor (MiB) the learner materializes: longer or wider batches
    compute the output head, softmax and logprobs over chunks of response positions,
    recomputed in the backward pass (large vocabularies). None: never chunk."""
    share_prompts: bool = True
    """Compute each distinct prompt of a batch once in the learner's forward, its keys and
    values shared by the prompt's samples (`models/prefix.py`; the same logprobs and
    gradients up to float rounding; on the demo an update of 224 rows took 58 ms of CPU
    against 90). Llama-family models on the torch backend, without `activation_checkpointing`,
    a sliding window or attention dropout; other models, and DeepSpeed, take every row
    whole."""


class EvalConfig(Section):
    """Held-out evaluation of published policy versions."""

    every: int = Field(10, ge=1, le=10_000_000)
    """Evaluate every this many versions (and the final one)."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    """Samples per held-out prompt."""
    temperature: float = Field(1.0, ge=0.0, le=4.0)
    """Sampling temperature; 0 is greedy."""
    max_new_tokens: int | None = Field(None, ge=1, le=131072)
    """Defaults to rollout.max_new_tokens."""
    threads: int = Field(1, ge=1, le=512)
    """Torch threads on CPU."""
    poll_interval_s: float = Field(0.5, gt=0.0, le=600.0)
    """Longest wait between checks for new versions (a published version wakes it sooner)."""
    when: Literal["during", "after"] = "during"
    """`during`: each due version is evaluated while the learner goes on, beside training (the
    live curve). `after`: the stage waits until the learner has finished, then evaluates the
    same versions in order, so that training has the machine to itself; what a benchmark
    needs when its peers pause their clocks to evaluate. A curve's time axis is each version's
    publish time either way. The store keeps every version owed an evaluation until it has one
    (about `total_steps / every` more versions on hand at the end of a run). An aborted run
    evaluates nothing more; in the Kubeflow sync pipeline the last round's evaluate task
    evaluates them all."""


class PromoteConfig(Section):
    """Registration of the chosen checkpoint in the model registry."""

    model_name: str = Field("shardrl-policy", min_length=1, max_length=200)
    """Registered model name."""
    metric: Literal["pass_at_1", "mean_reward"] = "pass_at_1"
    """Eval metric that ranks checkpoints and decides the champion."""
    choose: Literal["best", "last"] = "best"
    """Register the best evaluated version or the last one."""
    margin: float = Field(0.0, ge=0.0, le=1e6)
    """The challenger becomes champion only if it beats the champion by more than this."""
