"""vLLM engine on a GPU: generation, behaviour logprobs, in-place reload of a new version."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from shardrl.engines.hf import HFEngine
from shardrl.models.tiny import build_tiny_model, train_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs the `vllm` extra"),
]
TEXTS = ["12+7=", "abc", "the cat", "99-3=", "0123456789+-*= abcdefghijklmnopqrstuvwxyz"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from shardrl.engines.vllm import VLLMEngine

    out = tmp_path_factory.mktemp("vllm")
    tok = train_tokenizer(TEXTS, out / "tok")
    # head size 64 (256 / 4): a size every vLLM attention kernel supports
    model = build_tiny_model(tok, hidden_size=256, num_layers=2, num_heads=4,
                             intermediate_size=512, max_position_embeddings=128, seed=0)
    engine = VLLMEngine.from_model(model, tok, Path(out), fp32_lm_head=True,
                                   gpu_memory_utilization=0.3, dtype="float32")
    prompts = [tok(t)["input_ids"] for t in TEXTS[:4]]
    return engine, model, tok, prompts


def hf_engine(model, tok) -> HFEngine:
    return HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_greedy_tokens_match_the_transformers_engine(setup):
    engine, model, tok, prompts = setup
    ours = engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    theirs = hf_engine(model, tok).generate(prompts, 1, temperature=0.0, top_p=1.0,
                                            max_new_tokens=12, seed=0)
    assert [g[0].token_ids for g in ours] == [g[0].token_ids for g in theirs]
    assert all(lp == 0.0 for g in ours for lp in g[0].logprobs)


def test_sampled_logprobs_are_the_sampling_distributions(setup):
    from shardrl.models.heads import token_logprobs

    engine, model, _, prompts = setup
    groups = engine.generate(prompts, 4, temperature=0.7, top_p=1.0, max_new_tokens=12, seed=3)
    assert len({tuple(s.token_ids) for s in groups[0]}) > 1  # the samples of a group differ
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            ids = torch.tensor([prompt + s.token_ids])
            want = token_logprobs(model, ids, torch.ones_like(ids), len(prompt),
                                  temperature=0.7).logprobs[0]
            # processed logprobs at temperature 0.7 against the FP32-head learner, fp32 model
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=2e-3)


def test_new_version_is_loaded_in_place_and_checked(setup):
    engine, model, tok, prompts = setup
    torch.manual_seed(1)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine.load_weights(new, version=1)
    assert (engine.version, engine.rebuilds, engine.last_agreement) == (1, 0, 1.0)
    model.load_state_dict(new)
    ours = engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=12, seed=0)
    theirs = hf_engine(model, tok).generate(prompts, 1, temperature=0.0, top_p=1.0,
                                            max_new_tokens=12, seed=0)
    assert [g[0].token_ids for g in ours] == [g[0].token_ids for g in theirs]
