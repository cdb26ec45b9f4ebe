"""The torch learner backend: AdamW semantics, skipped steps, checkpoint state round trip."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardrl.config.stages import LearnerConfig
from shardrl.learner_backends import build_backend
from shardrl.learner_backends.base import STEP_KEY, moment_key
from shardrl.models.heads import Critic, token_logprobs

IDS = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 2]])
MASK = torch.ones_like(IDS)
START = torch.tensor([2, 1])


def lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


LEARNER = LearnerConfig(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=0.5)


def loss_of(policy) -> torch.Tensor:
    return -policy(IDS, MASK, START).logprobs.sum()


def test_steps_match_plain_adamw_with_global_clip():
    model, reference = lm(), lm()
    backend = build_backend(LEARNER, model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(2):
        applied, norm = backend.step(loss_of(backend.policy))
        opt.zero_grad()
        (-token_logprobs(reference, IDS, MASK, START).logprobs.sum()).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        assert applied and norm == pytest.approx(float(ref_norm), rel=1e-5)
        assert norm > 0.5  # the clip acted, so the comparison covers clipping
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_non_finite_loss_skips_and_leaves_weights():
    model = lm()
    before = copy.deepcopy(model.state_dict())
    backend = build_backend(LEARNER, model)
    applied, norm = backend.step(loss_of(backend.policy) * float("nan"))
    assert not applied and math.isnan(norm)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_set_lr_moves_only_the_named_part():
    critic = Critic.from_causal_lm(lm())
    backend = build_backend(LEARNER, lm(), critic=critic, critic_lr=3e-4)
    backend.set_lr("policy", 5e-3)
    lrs = {g["name"]: g["lr"] for g in backend.opt.param_groups}
    assert lrs == {"policy": 5e-3, "critic": 3e-4}


def test_state_round_trip_resumes_exactly():
    # uninterrupted: two steps
    straight = build_backend(LEARNER, lm())
    for _ in range(2):
        straight.step(loss_of(straight.policy))
    # interrupted after one step: weights and optimizer state carried to a fresh backend
    first = build_backend(LEARNER, lm())
    first.step(loss_of(first.policy))
    state = first.state_dict()
    assert state[STEP_KEY].item() == 1.0
    assert moment_key("policy", "model.embed_tokens.weight", "exp_avg") in state
    resumed_model = lm()
    resumed_model.load_state_dict(first.policy.lm.state_dict())
    resumed = build_backend(LEARNER, resumed_model)
    resumed.load_state_dict(state)
    resumed.step(loss_of(resumed.policy))
    for p, q in zip(resumed.policy.parameters(), straight.policy.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_missing_state_entries_are_named():
    backend = build_backend(LEARNER, lm())
    with pytest.raises(KeyError, match="lacks"):
        backend.load_state_dict({STEP_KEY: torch.tensor(1.0)})
