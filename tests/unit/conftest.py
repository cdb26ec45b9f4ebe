"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardrl.learner_backends import PolicyModule


@pytest.fixture
def tiny_policy() -> PolicyModule:
    """A seeded one-layer Llama (vocabulary 13, pad 0) behind the learner's PolicyModule."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=0, tie_word_embeddings=True)
    return PolicyModule(LlamaForCausalLM(cfg))
