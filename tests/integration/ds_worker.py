"""Run under `torchrun`: DeepSpeed backend vs torch backend on one batch, resume, skipped steps.

Every rank computes the learner's real loss (`compute_loss`) on the same batch. Each rank writes
`<out>/result-<rank>.json`: per ZeRO variant, the largest differences to the torch backend (losses,
gradient norms, weights after two steps), after resuming from a checkpoint of either backend,
and whether a non-finite loss left the weights alone.

usage: torchrun --nproc_per_node N ds_worker.py OUT_DIR VARIANT [VARIANT ...]
(VARIANT: a ZeRO stage 1, 2 or 3, with "+offload" for optimizer offload; "+bf16" for a resume
in bfloat16 (against DeepSpeed alone); or "critic": ZeRO-1 and ZeRO-3 training a critic too)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pyarrow as pa
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardrl.config import load_config
from shardrl.config.stages import DeepSpeedBackend, LearnerConfig
from shardrl.learner_backends import OptimSettings, build_backend
from shardrl.learner_backends.base import STEP_KEY
from shardrl.learner_backends.deepspeed_backend import DeepSpeedLearnerBackend
from shardrl.models.heads import Critic
from shardrl.stages.update import compute_loss

LEARNER = LearnerConfig(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=0.5)
CFG = load_config("demo", ["algo.aggregation=prompt", "algo.kl.placement=none",
                           "algo.is_correction.enabled=true"])


def lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def batch() -> pa.Table:
    """Two groups of two samples, with behaviour logprobs a little off the learner's."""
    floats = pa.list_(pa.float32())
    return pa.table({
        "group_id": [1, 1, 2, 2],
        "prompt_token_ids": [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]],
        "response_token_ids": [[8, 9, 2], [10, 2], [11, 12], [4, 5, 6, 2]],
        "advantage": [1.0, -1.0, 0.5, -0.5],
        "behavior_logprobs": pa.array([[-2.0, -2.5, -3.0], [-2.2, -2.4], [-2.6, -2.3],
                                       [-2.1, -2.9, -2.7, -2.5]], floats),
        "ref_logprobs": pa.array([None] * 4, floats),
    })


def run_steps(backend, steps: int, table: pa.Table) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for _ in range(steps):
        loss, _, _ = compute_loss(CFG, backend.policy, table, 0, beta=0.0)
        applied, norm = backend.step(loss)
        assert applied
        losses.append(float(loss.detach()))
        norms.append(norm)
    return losses, norms


def weights(backend) -> dict[str, torch.Tensor]:
    with backend.gathered():
        state = backend.policy.lm.state_dict()
        return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def deepspeed(variant: str, model: torch.nn.Module, learner: LearnerConfig = LEARNER,
              ) -> DeepSpeedLearnerBackend:
    """variant: the ZeRO stage, "+offload" for optimizer offload (e.g. "2+offload"), "+bf16"
    for bfloat16 training."""
    stage = int(variant[0])
    cfg = DeepSpeedBackend(zero_stage=stage, offload_optimizer=variant.endswith("+offload"),
                           bf16=variant.endswith("+bf16"))
    # threshold 0: ZeRO-3 partitions even this tiny model's parameters
    return DeepSpeedLearnerBackend(model, OptimSettings.from_config(learner), cfg,
                                   param_persistence_threshold=0 if stage == 3 else None)


def masters(backend) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for name, p in backend.policy.lm.named_parameters()}


def check_bf16(variant: str, table: pa.Table) -> dict:
    """Three steps in bfloat16 at a learning rate whose updates are below bfloat16's step
    near 1 (the norms' weights), against one step, a resume from its checkpoint state and
    two more: the float32 masters must come back, not their bfloat16 rounding."""
    slow = LEARNER.model_copy(update={"lr": 1e-4})
    through = deepspeed(variant, lm(), slow)
    run_steps(through, 3, table)
    first = deepspeed(variant, lm(), slow)
    run_steps(first, 1, table)
    state, after_one = first.state_dict(), weights(first)
    resumed = deepspeed(variant, with_weights(after_one), slow)
    resumed.load_state_dict(state)
    run_steps(resumed, 2, table)
    final, rounded = masters(through), weights(through)
    return {"master_keys": sum(k.endswith("/fp32") for k in state),
            "masters_diff": max_diff(masters(resumed), final),
            "weights_diff": max_diff(weights(resumed), rounded),
            "masters_off_weights": max_diff(final, rounded)}


def with_weights(state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = lm()
    model.load_state_dict(state)
    return model


def check_variant(stage: str, table: pa.Table) -> dict:
    torch_backend = build_backend(LEARNER, lm())
    t_losses, t_norms = run_steps(torch_backend, 2, table)
    t_final = weights(torch_backend)

    ds = deepspeed(stage, lm())
    d_losses, d_norms = run_steps(ds, 2, table)
    d_final = weights(ds)

    # resume from a DeepSpeed checkpoint after one step
    first = deepspeed(stage, lm())
    run_steps(first, 1, table)
    state, after_one = first.state_dict(), weights(first)
    # the checkpoint writer's form: the same tensors on rank 0, none held by the others
    held = first.state_dict(everywhere=False)
    leader_holds_all = (set(held) == ({STEP_KEY} if first.rank else set(state))
                        and max_diff(held, state if not first.rank else held) == 0.0)
    resumed = deepspeed(stage, with_weights(after_one))
    resumed.load_state_dict(state)
    run_steps(resumed, 1, table)

    # resume under DeepSpeed from a torch-backend checkpoint
    t_first = build_backend(LEARNER, lm())
    run_steps(t_first, 1, table)
    crossed = deepspeed(stage, with_weights(weights(t_first)))
    crossed.load_state_dict(t_first.state_dict())
    run_steps(crossed, 1, table)

    # a non-finite loss is skipped on every rank and leaves the weights alone
    before = weights(crossed)
    loss, _, _ = compute_loss(CFG, crossed.policy, table, 0, beta=0.0)
    applied, norm = crossed.step(loss * float("nan"))
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(t_losses, d_losses, strict=True)),
        "norm_diff": max(abs(a - b) for a, b in zip(t_norms, d_norms, strict=True)),
        "weight_diff": max_diff(t_final, d_final),
        "moved": max_diff(t_final, weights(build_backend(LEARNER, lm()))),
        "resume_diff": max_diff(weights(resumed), d_final),
        "cross_resume_diff": max_diff(before, t_final),
        "skipped": (not applied) and math.isnan(norm),
        "skip_changed": max_diff(weights(crossed), before),
        "world_size": ds.world_size,
        "broadcast": ds.broadcast_json({"from_rank": ds.rank, "keys": ["a", "b"]}),
        # how long a follower may wait in a collective for the leader's next plan
        "collective_timeout_s": torch.distributed.distributed_c10d._get_default_group()
        ._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
        "step_state": float(state["step"]),
        "leader_holds_all": leader_holds_all,
    }


def check_critic(stage: int, table: pa.Table) -> dict:
    """A critic in the loss too: both parts' weights and state against torch. The critic's
    value-head bias has one element, fewer than the ranks: padded partitions."""
    ids, mask, start = torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4, dtype=torch.long), \
        torch.tensor([2])
    weights_after, states = {}, {}
    ds_learner = LEARNER.model_copy(update={"backend": DeepSpeedBackend(zero_stage=stage)})
    for name in ("torch", "deepspeed"):
        lc = LEARNER if name == "torch" else ds_learner
        backend = build_backend(lc, lm(), critic=Critic.from_causal_lm(lm()), critic_lr=1e-3)
        loss, _, _ = compute_loss(CFG, backend.policy, table, 0, beta=0.0)
        applied, _ = backend.step(loss + backend.critic(ids, mask, start).pow(2).sum())
        assert applied
        states[name] = backend.state_dict()
        with backend.gathered():
            weights_after[name] = {f"{part}.{k}": v.detach().float().cpu().clone()
                                   for part, module in backend.parts.items()
                                   for k, v in module.state_dict().items()}
    fresh = build_backend(ds_learner, lm(), critic=Critic.from_causal_lm(lm()), critic_lr=1e-3)
    fresh.load_state_dict(states["torch"])  # builds the lazy state first, then fills it
    reloaded = fresh.state_dict()
    return {"weight_diff": max_diff(weights_after["torch"], weights_after["deepspeed"]),
            "state_diff": max_diff(states["torch"], states["deepspeed"]),
            "reload_diff": max_diff(states["torch"], reloaded),
            "critic_keys": sum(k.startswith("critic/") for k in reloaded)}


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    table = batch()
    results = {variant: (check_bf16 if variant.endswith("+bf16") else check_variant)(
        variant, table) for variant in variants if not variant.startswith("critic")}
    if "critic" in variants:
        results["critic"] = {str(stage): check_critic(stage, table) for stage in (1, 3)}
    out.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank()
    (out / f"result-{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from shardrl.cli import leave

    main()
    leave(0)  # as a learner rank ends: no interpreter teardown (see `leave`)
