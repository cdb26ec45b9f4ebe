"""The learner's shared-prompt forward: each distinct prompt once, the same logprobs,
entropies and gradients as the whole rows."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from shardrl.learner_backends.base import PolicyModule
from shardrl.models import prefix
from shardrl.models.heads import token_logprobs

PAD = 0


def llama(kv_heads: int, attention: str = "sdpa") -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=23, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads,
                         intermediate_size=48, max_position_embeddings=32, pad_token_id=PAD,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def rows(samples: list[tuple[list[int], list[int]]]):
    """Right-padded (input_ids, attention_mask, response_start, response_mask) of
    (prompt, response) pairs, as `stages.batch.build_batch` lays them out."""
    width = max(len(p) + len(r) for p, r in samples)
    ids = torch.full((len(samples), width), PAD)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (p, r) in enumerate(samples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
    starts = torch.tensor([len(p) for p, _ in samples])
    t = width - int(starts.min())
    mask = (torch.arange(t)[None, :] < torch.tensor([len(r) for _, r in samples])[:, None])
    return ids, attn, starts, mask


# three prompts of 4, 2 and 5 tokens; their samples' responses of 1 to 4 tokens
SAMPLES = [([1, 5, 6, 7], [9, 3]), ([1, 5, 6, 7], [4, 4, 8, 2]), ([1, 8], [3]),
           ([1, 5, 6, 7], [2]), ([1, 8], [7, 7, 2]), ([1, 9, 9, 4, 5], [6, 2]),
           ([1, 8], [5, 6, 3, 2])]


def test_distinct_prompts_of_right_padded_rows():
    ids, _, starts, _ = rows(SAMPLES)
    prompts, lengths, inverse = prefix.distinct_prompts(ids, starts)
    assert len(prompts) == 3 and sorted(lengths.tolist()) == [2, 4, 5]
    for i, (p, _) in enumerate(SAMPLES):
        u = int(inverse[i])
        assert prompts[u, : lengths[u]].tolist() == p
        assert prompts[u, lengths[u]:].eq(0).all()  # padded with 0 past the prompt


def outputs(model, share: bool, samples=SAMPLES, attention=None):
    ids, attn, starts, mask = rows(samples)
    if attention is not None:
        attn = attention
    model.zero_grad()
    out = token_logprobs(model, ids, attn, starts, temperature=0.7, share_prompts=share)
    loss = ((out.logprobs + 0.3 * out.entropy) * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads, mask


@pytest.mark.parametrize("kv_heads,attention", [(4, "sdpa"), (2, "sdpa"), (2, "eager")])
def test_the_shared_forward_gives_the_whole_rows_logprobs_and_gradients(kv_heads, attention):
    model = llama(kv_heads, attention)
    whole, g_whole, mask = outputs(model, share=False)
    shared, g_shared, _ = outputs(model, share=True)
    m = mask.bool()
    assert shared.logprobs.shape == whole.logprobs.shape
    torch.testing.assert_close(shared.logprobs[m], whole.logprobs[m], atol=2e-5, rtol=0)
    torch.testing.assert_close(shared.entropy[m], whole.entropy[m], atol=2e-5, rtol=0)
    assert torch.isfinite(shared.logprobs).all() and torch.isfinite(shared.entropy).all()
    for name, g in g_whole.items():
        torch.testing.assert_close(g_shared[name], g, atol=2e-5, rtol=1e-4, msg=name)


def mlp_inputs(model) -> list[tuple[int, ...]]:
    """The shapes the first decoder layer's MLP is called on (filled as the model runs)."""
    shapes = []
    model.base_model.layers[0].mlp.register_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape)))
    return shapes


def test_one_pass_computes_each_prompt_once_and_real_response_tokens_only():
    model = llama(2)
    shapes = mlp_inputs(model)
    outputs(model, share=True)
    # the 3 distinct prompts' 4 + 2 + 5 tokens, and response tokens 0 to n-2 of each row
    # (token n-1 predicts nothing), 1+3+0+0+2+1+3 = 10, packed in one call: not 7 rows x 8
    assert shapes == [(11 + 10, 32)]
    shapes.clear()
    outputs(model, share=False)
    assert shapes == [(7, 8, 32)]  # every row whole, the longest 8 tokens


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_both_ways_of_attending_give_the_whole_rows_logprobs_and_gradients(kv_heads,
                                                                           monkeypatch):
    """`attend` takes the fused kernel past `SMALL_ATTENTION` scores: with a limit of 0
    every attention of the shared pass does, and the results are the same."""
    model = llama(kv_heads)
    whole, g_whole, mask = outputs(model, share=False)
    calls = []
    fused = prefix.F.scaled_dot_product_attention
    monkeypatch.setattr(prefix, "SMALL_ATTENTION", 0)
    monkeypatch.setattr(prefix.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    shared, g_shared, _ = outputs(model, share=True)
    assert len(calls) == 2 * 2  # prompts and responses, in each of the 2 layers
    m = mask.bool()
    torch.testing.assert_close(shared.logprobs[m], whole.logprobs[m], atol=2e-5, rtol=0)
    torch.testing.assert_close(shared.entropy[m], whole.entropy[m], atol=2e-5, rtol=0)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_shared[name], g, atol=2e-5, rtol=1e-4, msg=name)


def test_keys_come_in_blocks_of_16_with_the_padding_masked(monkeypatch):
    """CPU softmax is slow on widths that are not a multiple of 16: every attention of the
    shared pass gets a padded key width, and no query attends to the padding."""
    model = llama(2)
    seen = []
    attend = prefix.attend

    def spy(q, k, v, bias, scale):
        seen.append(k.shape[2])
        masked = bias.eq(torch.finfo(bias.dtype).min).all(dim=(0, 1, 2))  # (K,) per key
        seen.append(int((~masked).nonzero().max()) + 1)  # keys some query attends to
        return attend(q, k, v, bias, scale)

    monkeypatch.setattr(prefix, "attend", spy)
    outputs(model, share=True)
    # per layer: the prompts (the longest 5 tokens, in 16 keys), then the responses (their
    # prompts' 5 positions and 3 response positions, in 16 keys)
    assert seen == [16, 5, 16, 8] * 2


def test_attend_matches_the_fused_kernel_with_grouped_queries():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)
    allowed = torch.rand(3, 1, 5, 7) > 0.4
    allowed[..., 0] = True  # every query sees at least one key
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3,
                                                            enable_gqa=True)
    torch.testing.assert_close(prefix.attend(q, k, v, bias, 0.3), want, atol=1e-5, rtol=1e-5)


def test_left_padded_rows_and_other_models_take_the_whole_rows():
    model = llama(2)
    samples = [([1, 5], [9, 3]), ([1, 6], [4])]
    ids, attn, starts, _ = rows(samples)
    assert prefix.right_padded(attn, starts)
    left = attn.clone()
    left[1, 0] = 0  # row 1's first token is padding: not a right-padded batch
    assert not prefix.right_padded(left, starts)
    seen = []
    model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True)
    outputs(model, share=True, samples=samples, attention=left)
    assert seen == [torch.Size([2, 4])]
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=23, n_embd=16, n_layer=1, n_head=2))
    assert not prefix.supports(gpt2) and prefix.supports(model)
    (getattr(model, "activation_checkpointing_enable", None)
     or model.gradient_checkpointing_enable)()
    assert not prefix.supports(model)


def test_the_policy_module_shares_prompts_when_asked():
    model = llama(2)
    ids, attn, starts, mask = rows(SAMPLES)
    shapes = mlp_inputs(model)
    PolicyModule(model)(ids, attn, starts)
    PolicyModule(model, share_prompts=True)(ids, attn, starts)
    assert shapes == [(7, 8, 32), (21, 32)]
