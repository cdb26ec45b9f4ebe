"""The transformers engine: behaviour log-probabilities, stop reasons, seeding, weight swaps."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardrl.engines.base import mixed_seed
from shardrl.engines.hf import HFEngine, StaticDecoder, sampling_logprobs
from shardrl.models.tiny import build_tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(["0123456789+="], tmp_path_factory.mktemp("tok"))


def make_engine(tokenizer, seed=0, **kwargs):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4,
                             intermediate_size=64, max_position_embeddings=64, seed=seed)
    return HFEngine(model, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, **kwargs)


def test_top_p_renormalises_the_nucleus():
    # probs (0.5, 0.3, 0.2): with top_p=0.7 the nucleus is {0, 1} (0.5 < 0.7 <= 0.8),
    # renormalised to (0.5/0.8, 0.3/0.8) = (0.625, 0.375); token 2 gets probability 0.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    probs = sampling_logprobs(logits, 1.0, 0.7).exp()
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0]]))
    # temperature 0.5 squares and renormalises: (25, 9, 4) / 38
    probs = sampling_logprobs(logits, 0.5, 1.0).exp()
    torch.testing.assert_close(probs, torch.tensor([[25 / 38, 9 / 38, 4 / 38]]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_recomputation(tokenizer, temperature):
    engine = make_engine(tokenizer)
    # prompts of different lengths, so the batch is left-padded
    prompts = [tokenizer(s).input_ids for s in ["1+2=", "345+678=", "9="]]
    out = engine.generate(prompts, 3, temperature=temperature, top_p=1.0,
                          max_new_tokens=8, seed=5)
    assert [len(group) for group in out] == [3, 3, 3]
    with torch.no_grad():
        for prompt, group in zip(prompts, out, strict=True):
            for sample in group:
                ids = torch.tensor([prompt + sample.token_ids])  # (1, T), no padding
                logits = engine.model(input_ids=ids).logits[0].float() / temperature
                logp = torch.log_softmax(logits, -1)  # (T, V)
                start = len(prompt) - 1  # logits at t predict token t+1
                expected = [logp[start + i, tok].item() for i, tok in enumerate(sample.token_ids)]
                assert sample.logprobs == pytest.approx(expected, abs=1e-4)


def test_finish_reason_length_and_stop(tokenizer):
    engine = make_engine(tokenizer)
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    prompt = [tokenizer("1+1=").input_ids]

    def force_eos_head(hidden):  # logits with eos at +50 and everything else at 0
        logits = torch.zeros(hidden.shape[0], vocab)
        logits[:, eos] = 50.0
        return logits

    engine._logits = force_eos_head
    [[stop]] = engine.generate(prompt, 1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0)
    assert stop.finish_reason == "stop" and stop.token_ids == [eos]

    def never_eos_head(hidden):  # eos at -inf: generation must run to max_new_tokens
        logits = torch.zeros(hidden.shape[0], vocab)
        logits[:, eos] = float("-inf")
        return logits

    engine._logits = never_eos_head
    [[length]] = engine.generate(prompt, 1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0)
    assert length.finish_reason == "length" and len(length.token_ids) == 5
    assert eos not in length.token_ids
    # uniform over the other V-1 tokens: each logprob is -log(V-1)
    assert length.logprobs == pytest.approx([-math.log(vocab - 1)] * 5, abs=1e-5)


def test_same_seed_same_samples_other_seed_differs(tokenizer):
    engine = make_engine(tokenizer)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("5+6=").input_ids]
    kwargs = dict(temperature=1.0, top_p=1.0, max_new_tokens=6)
    first = engine.generate(prompts, 4, seed=3, **kwargs)
    assert engine.generate(prompts, 4, seed=3, **kwargs) == first
    assert engine.generate(prompts, 4, seed=4, **kwargs) != first


def test_load_weights_swaps_in_place(tokenizer, tmp_path):
    engine = make_engine(tokenizer, seed=0)
    other = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4,
                             intermediate_size=64, max_position_embeddings=64, seed=1)
    prompts = [tokenizer("12+34=").input_ids]
    # sampling, not greedy: two random models often share an argmax, never their logprobs
    kwargs = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0)
    before = engine.generate(prompts, 1, **kwargs)
    model_id = id(engine.model)
    other.save_pretrained(tmp_path)  # a directory of safetensors, as the store holds it
    engine.load_weights(tmp_path, version=7)
    assert engine.version == 7 and id(engine.model) == model_id
    after = engine.generate(prompts, 1, **kwargs)
    assert after == fresh_engine_samples(other, prompts, **kwargs)
    assert after[0][0].logprobs != before[0][0].logprobs
    with pytest.raises(KeyError):
        engine.load_weights({"not.a.weight": torch.zeros(1)}, version=8)


def test_load_weights_copies_every_tensor_and_checks_shapes(tokenizer):
    engine = make_engine(tokenizer, seed=0)
    other = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=4,
                             intermediate_size=64, max_position_embeddings=64, seed=1)
    state = {k: t.clone() for k, t in other.state_dict().items()}
    engine.load_weights(state, version=3)
    mine = engine.model.state_dict()
    assert all(torch.equal(mine[k], t) for k, t in state.items())
    # copies, not the caller's tensors: changing them later leaves the model alone
    next(iter(state.values())).add_(1.0)
    assert not torch.equal(mine[next(iter(state))], next(iter(state.values())))
    # a tensor missing from the state (not a tied one) and a wrong shape are refused
    partial = dict(state)
    partial.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights(partial, version=4)
    wrong = dict(state, **{"model.norm.weight": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"model.norm.weight: \(7,\)"):
        engine.load_weights(wrong, version=4)
    assert engine.version == 3


def fresh_engine_samples(model, prompts, **kwargs):
    """Samples of `model` through a fresh engine, to compare with the swapped one."""
    fresh = HFEngine(model, eos_token_id=model.config.eos_token_id,
                     pad_token_id=model.config.pad_token_id)
    return fresh.generate(prompts, 1, **kwargs)


def grouped_query_model(tokenizer, attn_implementation):
    """A Llama with 4 query heads sharing 2 key/value heads, as SmolLM2's attention does."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id,
                         attn_implementation=attn_implementation)
    torch.manual_seed(3)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("kind", ["tiny", "grouped-eager", "grouped-sdpa"])
def test_static_cache_decoding_samples_what_the_models_forward_samples(tokenizer, kind,
                                                                      monkeypatch):
    model = (make_engine(tokenizer).model if kind == "tiny"
             else grouped_query_model(tokenizer, kind.split("-")[1]))
    engine = HFEngine(model, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    # left padding of different widths, top-p and several samples per prompt
    prompts = [tokenizer(s).input_ids for s in ["1+2=", "345+678=", "9=", "12+3="]]
    kwargs = dict(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=11)
    built = []
    monkeypatch.setattr(StaticDecoder, "step", _recording(StaticDecoder.step, built))
    static = engine.generate(prompts, 3, **kwargs)
    assert built, "the static-cache path did not run"
    monkeypatch.setattr(StaticDecoder, "ARCHITECTURES", ())  # decode through forward()
    built.clear()
    forward = engine.generate(prompts, 3, **kwargs)
    assert not built
    for group_s, group_f in zip(static, forward, strict=True):
        for s, f in zip(group_s, group_f, strict=True):
            assert s.token_ids == f.token_ids and s.finish_reason == f.finish_reason
            # eager attention written out: the same operations as the model's, except that
            # the keys come in blocks of 16 (the softmax and the weighted sum run on other
            # kernels) and, without grouped heads, the weighted sum of values is a
            # multiply-add, which sums in another order (float32 rounding)
            tol = {"grouped-sdpa": 1e-5}.get(kind, 1e-6)
            assert s.logprobs == pytest.approx(f.logprobs, abs=tol)


def _recording(step, calls):
    def wrapped(self, tokens, positions):
        calls.append(tokens.shape[0])
        return step(self, tokens, positions)
    return wrapped


def test_static_decoder_declines_other_architectures(tokenizer, monkeypatch):
    engine = make_engine(tokenizer)
    ids = torch.tensor([tokenizer("1+2=").input_ids])
    cache = engine.model.base_model(input_ids=ids, use_cache=True).cache
    assert StaticDecoder.supports(engine.model, cache)
    # same layers, a sliding window possible
    monkeypatch.setattr(engine.model.config, "model_type", "mistral")
    assert not StaticDecoder.supports(engine.model, cache)


def test_seeds_of_nearby_batches_and_workers_differ():
    """Seeds were `base + batch` (and vLLM's requests `seed + i * n + j`): batch b's request
    j + 1 drew what batch b + 1's request j drew, and worker w at shard s + 100_003 what
    worker w + 1 drew at shard s. Hashed together, none of them repeat."""
    assert mixed_seed(0, 1, 2) == mixed_seed(0, 1, 2)  # a function of its parts
    batches = {mixed_seed(seed, i, j) for seed in range(10, 20) for i in range(8) for j in range(8)}
    assert len(batches) == 10 * 8 * 8
    workers = {mixed_seed(0, w, s) for w in range(4) for s in (0, 100_003, 200_006)}
    assert len(workers) == 12
    assert all(0 <= s < 2**63 for s in batches | workers)  # a valid torch or vLLM seed
