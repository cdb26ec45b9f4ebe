"""The learner trains with dropout off (LoRA's excepted): its logprobs are those of the policy
the engines sample, and a resumed or replayed step draws no masks."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from shardrl.models.dropout import disable_dropout
from shardrl.models.lora import add_lora


def logprobs_twice(model) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.arange(2, 18).reshape(2, 8)
    with torch.no_grad():
        return (torch.log_softmax(model(ids).logits, -1), torch.log_softmax(model(ids).logits, -1))


def test_gpt2_dropout_layers_are_turned_off():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                       n_positions=16, resid_pdrop=0.3, embd_pdrop=0.3,
                                       attn_pdrop=0.3))
    a, b = logprobs_twice(model)
    assert not torch.equal(a, b)  # training mode draws masks
    # the embedding's, and per block the attention's two and the MLP's one
    assert disable_dropout(model) == 1 + 2 * 3
    assert model.config.resid_pdrop == model.config.attn_pdrop == 0.0
    a, b = logprobs_twice(model)
    assert torch.equal(a, b)
    assert disable_dropout(model) == 0  # nothing left on


def test_llama_attention_dropout_is_turned_off_and_loras_kept():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, vocab_size=64,
                                         max_position_embeddings=16, attention_dropout=0.5))
    model.config._attn_implementation = "eager"  # where the attention's dropout applies
    a, b = logprobs_twice(model)
    assert not torch.equal(a, b)
    model = add_lora(model, r=2, alpha=4, dropout=0.25, target_modules=["q_proj"], seed=0)
    assert disable_dropout(model) == 2  # the two attention layers' probability
    assert model.config.attention_dropout == 0.0
    kept = [m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert kept == [0.25, 0.25]  # LoRA's, one per adapted q_proj
    for layer in model.model.layers:  # the adapters' B is zero at first: LoRA's masks vanish
        assert layer.self_attn.attention_dropout == 0.0
    a, b = logprobs_twice(model)
    assert torch.equal(a, b)
