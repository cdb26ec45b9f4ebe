"""Bounded learner memory: gradient accumulation over micro-batches gives the whole batch's
loss and gradient in every aggregation mode, and chunked logits give the unchunked logprobs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from shardrl.config import load_config
from shardrl.learner_backends.torch_backend import apply_step
from shardrl.models.heads import logits_chunk, token_logprobs
from shardrl.stages.batch import build_batch
from shardrl.stages.update import (
    aggregation_weights,
    compute_loss,
    micro_losses,
    plan_micro_batches,
    row_lengths,
    update_loss,
)


def test_aggregation_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    groups = torch.tensor([7, 7, 9])

    def weights(mode: str) -> torch.Tensor:
        return aggregation_weights(mask, mode, groups)

    s = 1 / 6  # token: 6 tokens in the batch
    assert torch.allclose(weights("token"), torch.tensor([[s, s, 0], [s, 0, 0], [s, s, s]]))
    # sample: mean over 3 samples of each one's token mean
    assert torch.allclose(weights("sample"), torch.tensor(
        [[1 / 6, 1 / 6, 0], [1 / 3, 0, 0], [1 / 9, 1 / 9, 1 / 9]]))
    # prompt: group 7 has 3 tokens, group 9 has 3; mean over the 2 groups
    assert torch.allclose(weights("prompt"), torch.tensor([[s, s, 0], [s, 0, 0], [s, s, s]]))
    groups = torch.tensor([7, 8, 8])  # group 7: 2 tokens, group 8: 4 tokens
    assert torch.allclose(weights("prompt"), torch.tensor(
        [[1 / 4, 1 / 4, 0], [1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]))


def _table(policy) -> pa.Table:
    """Five samples in two groups, responses of 1 to 4 tokens, behaviour = learner."""
    responses = [[5, 6, 7, 8], [7], [5, 7, 9], [6, 8], [9, 10, 11]]
    table = pa.table({"prompt_id": [0, 0, 0, 1, 1], "group_id": [0, 0, 0, 1, 1],
                      "sample_idx": [0, 1, 2, 0, 1],
                      "prompt_token_ids": [[3, 4], [3, 4], [3, 4], [2, 3, 4], [2, 3, 4]],
                      "response_token_ids": responses,
                      "advantage": [1.0, -0.5, -0.5, 2.0, -2.0]})
    batch = build_batch(table, pad_id=0)
    with torch.no_grad():
        logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    rows = [row[: len(r)] for row, r in zip(logp.tolist(), responses, strict=True)]
    # behaviour a little off the learner, so ratios and clipping are not all trivial
    rows = [[x - 0.05 * (i % 3) for i, x in enumerate(row)] for row in rows]
    return table.append_column("behavior_logprobs", pa.array(rows, pa.list_(pa.float32()))) \
        .append_column("ref_logprobs", pa.array(rows, pa.list_(pa.float32())))


def _grads(policy) -> list[torch.Tensor]:
    return [p.grad.clone() for p in policy.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", ["token", "sample", "prompt"])
@pytest.mark.parametrize("extra", [[], ["algo.advantages.norm=batch", "algo.entropy_coef=0.01",
                                        "algo.kl.placement=loss"]])
def test_micro_batches_add_up_to_the_whole_batch(tiny_policy, mode, extra):
    policy = tiny_policy
    cfg = load_config("demo", [f"algo.aggregation={mode}", *extra])
    table = _table(policy)
    whole, metrics, _ = compute_loss(cfg, policy, table, 0, beta=0.1)
    policy.zero_grad()
    whole.backward()
    expected = _grads(policy)
    for size in (1, 2, 3):
        got: dict = {}
        policy.zero_grad()
        total = torch.zeros(())
        for loss in micro_losses(cfg, policy, table, 0, 0.1, size, got):
            loss.backward()
            total = total + loss.detach()
        assert total.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
        for a, b in zip(_grads(policy), expected, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
        for key in ("policy_loss", "total_loss", "entropy", "logprob_mismatch_abs"):
            assert float(got[key]) == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-7), key


def test_an_accumulated_step_equals_the_whole_batch_step(tiny_policy):
    cfg = load_config("demo", ["algo.aggregation=prompt"])
    table = _table(tiny_policy)
    start = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    opt = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-2)
    loss, _, _ = compute_loss(cfg, tiny_policy, table, 0, beta=0.0)
    assert apply_step(loss, list(tiny_policy.parameters()), [opt], 1.0)[0]
    one = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    tiny_policy.load_state_dict(start)
    opt = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-2)
    applied, _ = apply_step(micro_losses(cfg, tiny_policy, table, 0, 0.0, 2, {}),
                            list(tiny_policy.parameters()), [opt], 1.0)
    assert applied
    for k, v in tiny_policy.state_dict().items():
        assert torch.allclose(v, one[k], atol=1e-6), k
    # a non-finite micro-batch loss skips the whole step
    assert apply_step(iter([torch.tensor(1.0, requires_grad=True), torch.tensor(float("nan"))]),
                      list(tiny_policy.parameters()), [opt], 1.0) == (False, pytest.approx(
                          float("nan"), nan_ok=True))


def test_chunked_logits_equal_the_whole_ones_with_their_gradients(tiny_policy):
    lm = tiny_policy.lm
    batch = build_batch(_table(tiny_policy), pad_id=0)
    args = (lm, batch.input_ids, batch.attention_mask, batch.response_start)
    whole = token_logprobs(*args, temperature=0.7)
    (whole.logprobs.sum() + whole.entropy.sum()).backward()
    expected = _grads(tiny_policy)
    for chunk in (1, 2, 3):
        lm.zero_grad()
        out = token_logprobs(*args, temperature=0.7, chunk=chunk)
        assert torch.allclose(out.logprobs, whole.logprobs, atol=1e-6)
        assert torch.allclose(out.entropy, whole.entropy, atol=1e-6)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        for a, b in zip(_grads(tiny_policy), expected, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():  # no checkpointing without gradients: the same values
        assert torch.allclose(token_logprobs(*args, chunk=2).logprobs,
                              token_logprobs(*args).logprobs, atol=1e-6)


def test_logits_chunk_fits_the_budget():
    # 1 MiB of float32 = 262144 values; 8 rows x 4096 vocabulary = 32768 per position
    assert logits_chunk(8, 4096, 1.0) == 8
    assert logits_chunk(64, 49152, 1.0) == 1  # never below one position
    assert logits_chunk(8, 4096, None) is None


def test_activation_checkpointing_keeps_the_gradient_and_saves_less():
    """With transformers' gradient checkpointing the backward pass gives the same gradients
    while the forward keeps fewer bytes for it (counted through autograd's saved-tensor
    hooks): each block's input instead of everything inside the blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardrl.learner_backends import PolicyModule

    def run(checkpointing: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=13, hidden_size=16, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
        policy = PolicyModule(lm)
        ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [7, 8, 9, 2, 4, 4, 5, 6]])
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = -policy(ids, torch.ones_like(ids), torch.tensor([2, 3])).logprobs.sum()
        loss.backward()
        return [p.grad.clone() for p in lm.parameters()], sum(saved)

    plain, plain_bytes = run(False)
    ckpt, ckpt_bytes = run(True)
    for a, b in zip(plain, ckpt, strict=True):
        torch.testing.assert_close(a, b)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)


def test_token_budget_plan_sorts_rows_and_bounds_padded_tokens():
    lengths = np.array([9, 3, 5, 3, 12, 4])
    order, parts = plan_micro_batches(lengths, rows=None, tokens=12)
    # shortest first (ties keep their order): 3 3 4 | 5 | 9 | 12, each part rows x longest <= 12
    assert order.tolist() == [1, 3, 5, 2, 0, 4]
    assert parts == [(0, 3), (3, 4), (4, 5), (5, 6)]
    # with a row bound too: 3 3 | 4 5 (2 x 5 = 10 tokens) | 9 | 12
    assert plan_micro_batches(lengths, rows=2, tokens=12)[1] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    # a row longer than the budget is a part of its own
    assert plan_micro_batches(np.array([20, 2]), rows=None, tokens=8)[1] == [(0, 1), (1, 2)]
    order, parts = plan_micro_batches(lengths, rows=4, tokens=None)  # rows alone: in order
    assert order.tolist() == list(range(6)) and parts == [(0, 4), (4, 6)]
    assert plan_micro_batches(np.array([], dtype=np.int64), None, 8)[1] == []


@pytest.mark.parametrize("mode", ["token", "sample", "prompt"])
def test_a_token_budget_step_equals_the_whole_batch_step(tiny_policy, mode, monkeypatch):
    from shardrl.stages import update

    table = _table(tiny_policy)  # rows of 6, 3, 5, 5 and 6 tokens
    whole_cfg = load_config("demo", [f"algo.aggregation={mode}"])
    split_cfg = load_config("demo", [f"algo.aggregation={mode}", "learner.micro_batch_tokens=10"])
    loss, metrics = update_loss(whole_cfg, tiny_policy, table, 0, 0.0)
    assert isinstance(loss, torch.Tensor)
    tiny_policy.zero_grad()
    loss.backward()
    expected = _grads(tiny_policy)
    seen = []  # each micro-batch's row lengths, in the order trained
    real = update.compute_loss

    def recording(cfg, policy, part, *args, **kwargs):
        seen.append(row_lengths(part).tolist())
        return real(cfg, policy, part, *args, **kwargs)

    monkeypatch.setattr(update, "compute_loss", recording)
    losses, got = update_loss(split_cfg, tiny_policy, table, 0, 0.0)
    tiny_policy.zero_grad()
    for part in losses:
        part.backward()
    # shortest rows first, each micro-batch at most 10 padded tokens: 3 5 | 5 | 6 | 6 (in
    # table order the first two rows alone, 6 and 3, would pad to 12)
    assert seen == [[3, 5], [5], [6], [6]]
    monkeypatch.setattr(update, "compute_loss", real)
    for a, b in zip(_grads(tiny_policy), expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    for key in ("policy_loss", "entropy", "logprob_mismatch_abs"):
        assert float(got[key]) == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-7), key
    # DeepSpeed (or GAE) cannot split a batch: the budget leaves it whole
    loss, _ = update_loss(split_cfg, tiny_policy, table, 0, 0.0, backend_kind="deepspeed")
    assert isinstance(loss, torch.Tensor)
