"""Heads: token logprobs vs a naive computation, FP32 head, critic, reward model loading."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from shardrl.models.heads import (
    Critic,
    RewardModelError,
    load_reward_model,
    score_texts,
    token_logprobs,
)
from shardrl.models.io import save_model

V = 11


def config(**kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        tie_word_embeddings=False,
        **kw,
    )


def lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config()).eval()


def test_token_logprobs_match_naive_computation():
    model = lm()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6]])  # (B=2, L=6)
    mask = torch.ones_like(ids)
    temperature = 0.7
    out = token_logprobs(
        model,
        ids,
        mask,
        response_start=torch.tensor([3, 4]),
        temperature=temperature,
        return_logits=True,
    )
    # T = L - min(start) = 6 - 3 = 3; row 1 has only 2 response tokens (ids[1, 4:6]).
    assert out.logprobs.shape == (2, 3) and out.entropy.shape == (2, 3)
    full = model(ids).logits.float() / temperature  # (B, L, V) naive: whole head, then slice
    logp = torch.log_softmax(full, -1)
    for b, start in enumerate([3, 4]):
        for t in range(6 - start):
            pos = start + t  # token predicted from hidden state at pos - 1
            expected = logp[b, pos - 1, ids[b, pos]]
            entropy = -(logp[b, pos - 1].exp() * logp[b, pos - 1]).sum()
            torch.testing.assert_close(out.logprobs[b, t], expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.entropy[b, t], entropy, rtol=1e-5, atol=1e-5)
    assert out.logprobs[1, 2] == 0.0 and out.entropy[1, 2] == 0.0  # past the end of row 1
    torch.testing.assert_close(out.logits[0, 0], full[0, 2] * temperature, rtol=1e-5, atol=1e-5)


def test_the_head_runs_on_real_response_tokens_only():
    # right-padded rows whose responses have 3, 1 and 2 tokens: 6 positions through the head,
    # not 3 rows x 3; the logprobs, entropies and gradients those of every position's head
    # (`return_logits` computes the head on all of them), zeros on the padding
    model = lm().train()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0], [1, 2, 6, 7, 0, 0]])
    mask = (ids != 0).long()
    starts = torch.tensor([3, 3, 2])
    real = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))

    def run(**kw):
        model.zero_grad()
        # the head as a module call (float32 already), so the hook sees its input
        out = token_logprobs(model, ids, mask, starts, temperature=0.7, fp32_lm_head=False, **kw)
        ((out.logprobs + 0.3 * out.entropy) * real).sum().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, grads = run()
    assert seen == [torch.Size([1, 6, 16])]
    whole, whole_grads = run(return_logits=True)
    assert packed.logprobs.shape == whole.logprobs.shape == (3, 4)
    torch.testing.assert_close(packed.logprobs[real], whole.logprobs[real], rtol=0, atol=1e-6)
    torch.testing.assert_close(packed.entropy[real], whole.entropy[real], rtol=0, atol=1e-6)
    assert packed.logprobs[~real].eq(0).all() and packed.entropy[~real].eq(0).all()
    for name, g in whole_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    seen.clear()
    chunked, chunked_grads = run(chunk=1)  # 3 rows x 1: positions 0-2, 3-5
    # each chunk once forward and once again in the backward pass (checkpointed)
    assert [s[1] for s in seen] == [3, 3, 3, 3]
    torch.testing.assert_close(chunked.logprobs, packed.logprobs, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(chunked_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_left_padding_does_not_change_logprobs():
    # Pads are masked out of attention and positions count real tokens only, so the
    # padded row must reproduce the unpadded one.
    model = lm()
    plain = token_logprobs(
        model, torch.tensor([[1, 5, 6, 7]]), torch.ones(1, 4, dtype=torch.long), 2
    )
    padded = token_logprobs(
        model, torch.tensor([[0, 0, 1, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1, 1]]), 4
    )
    torch.testing.assert_close(padded.logprobs, plain.logprobs, rtol=1e-5, atol=1e-5)


def test_fp32_head_on_bf16_model_gives_float32_logits():
    model = lm().to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    out = token_logprobs(model, ids, mask, 2, return_logits=True)
    assert out.logits.dtype == torch.float32 and out.logprobs.dtype == torch.float32
    # The FP32 head multiplies the bf16 hidden states upcast by the weight upcast.
    hidden = model.model(ids).last_hidden_state  # (1, 5, H) bf16
    expected = hidden[:, 1:4].float() @ model.lm_head.weight.float().T
    torch.testing.assert_close(out.logits, expected, rtol=1e-6, atol=1e-6)
    low = token_logprobs(model, ids, mask, 2, fp32_lm_head=False, return_logits=True)
    assert not torch.equal(low.logits, out.logits)  # bf16 head rounds its logits


def test_logprobs_carry_gradients_to_the_model():
    model = lm()
    ids = torch.tensor([[1, 5, 6, 7]])
    token_logprobs(model, ids, torch.ones_like(ids), 2).logprobs.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_critic_shapes_copy_and_save_load(tmp_path):
    policy = lm()
    critic = Critic.from_causal_lm(policy)
    # The critic holds a copy: training it must not move the policy's weights.
    assert (
        critic.backbone.embed_tokens.weight.data_ptr()
        != policy.model.embed_tokens.weight.data_ptr()
    )
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    values = critic.values(ids, mask)
    assert values.shape == (2, 5) and values.dtype == torch.float32
    # Hand check of the head: value = w . h + b with b = 0 at init.
    hidden = critic.backbone(ids[:1]).last_hidden_state[0]  # (L, H)
    torch.testing.assert_close(
        values[0], hidden @ critic.value_head.weight[0], rtol=1e-5, atol=1e-6
    )
    # response_values[:, t] = values[:, start + t - 1]
    torch.testing.assert_close(critic.response_values(ids, mask, 3), values[:, 2:4])

    manifest = critic.save(tmp_path / "critic")
    assert set(manifest) == {"config.json", "critic.safetensors"}
    restored = Critic.load(tmp_path / "critic")
    torch.testing.assert_close(restored.values(ids, mask), values)


def test_reward_model_with_one_label_loads_and_scores(tmp_path):
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config(num_labels=1)).eval()
    save_model(rm, None, tmp_path / "rm")
    loaded = load_reward_model(tmp_path / "rm")

    class CharTok:  # ids = character codes folded into the vocabulary, no specials
        def __call__(self, texts):
            return {"input_ids": [[1 + ord(c) % (V - 1) for c in t] for t in texts]}

    texts = ["abc", "a", "abcdef"]
    batched = score_texts(loaded, CharTok(), texts, batch_size=2)
    # A text's score is the head applied at its own last token, whatever its batch mates.
    singles = [rm(torch.tensor(CharTok()([t])["input_ids"])).logits[0, 0].item() for t in texts]
    assert batched == pytest.approx(singles, abs=1e-5)


def test_reward_model_with_wrong_head_is_refused(tmp_path):
    save_model(LlamaForSequenceClassification(config(num_labels=2)), None, tmp_path / "two")
    with pytest.raises(RewardModelError, match="num_labels=2.*num_labels=1"):
        load_reward_model(tmp_path / "two")
    save_model(lm(), None, tmp_path / "causal")
    with pytest.raises(RewardModelError, match="holds LlamaForCausalLM.*ForSequenceClassification"):
        load_reward_model(tmp_path / "causal")
