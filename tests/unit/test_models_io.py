"""Model I/O: safetensors round trip, pickle refusal, manifests, tokenizer compatibility."""

from __future__ import annotations

import hashlib

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardrl.models.io import (
    ManifestMismatch,
    TokenizerMismatch,
    UnsafeWeightsError,
    check_tokenizers_match,
    load_causal_lm,
    load_state_dict_from_safetensors,
    load_tokenizer,
    save_model,
    state_dict_bytes,
    verify_manifest,
)

WORDS = "what is one plus two the answer three four five six"


def make_tokenizer(extra: str = "", pad: str = "<pad>") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    tok.train_from_iterator([WORDS + " " + extra], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token=pad, unk_token="<unk>"
    )


def make_model(vocab_size: int, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def test_save_load_round_trip(tmp_path):
    tok = make_tokenizer()
    model = make_model(len(tok))
    manifest = save_model(model, tok, tmp_path / "m")
    # The manifest lists the weights with the sha256 of the bytes on disk.
    weights = (tmp_path / "m" / "model.safetensors").read_bytes()
    assert manifest["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    assert "tokenizer.json" in manifest and "config.json" in manifest
    verify_manifest(tmp_path / "m", manifest)

    loaded = load_causal_lm(tmp_path / "m")
    ids = torch.tensor([[2, 4, 5, 6]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.dtype == torch.float32
    tok2 = load_tokenizer(tmp_path / "m")
    assert tok2("what is one")["input_ids"] == tok("what is one")["input_ids"]
    check_tokenizers_match(tok, tok2)
    bf16 = load_causal_lm(tmp_path / "m", dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_planted_pickle_is_refused(tmp_path):
    tok = make_tokenizer()
    save_model(make_model(len(tok)), tok, tmp_path / "m")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(UnsafeWeightsError, match="pytorch_model.bin"):
        load_causal_lm(tmp_path / "m")


def test_directory_without_safetensors_is_refused(tmp_path):
    tok = make_tokenizer()
    save_model(make_model(len(tok)), tok, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(UnsafeWeightsError, match="no \\*.safetensors"):
        load_causal_lm(tmp_path / "m")


def test_manifest_mismatch_is_detected(tmp_path):
    tok = make_tokenizer()
    manifest = save_model(make_model(len(tok)), tok, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "extra.safetensors").write_bytes(b"x")
    (tmp_path / "m" / "notes.txt").write_text("metadata beside the model is tolerated")
    with pytest.raises(ManifestMismatch) as err:
        verify_manifest(tmp_path / "m", manifest)
    message = str(err.value)
    assert "config.json: sha256" in message
    assert "unexpected weights file extra.safetensors" in message
    assert "notes.txt" not in message
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ManifestMismatch, match="missing tokenizer.json"):
        verify_manifest(tmp_path / "m", manifest)


def test_tokenizer_mismatch_lists_every_difference():
    base = make_tokenizer()
    check_tokenizers_match(base, make_tokenizer())  # identical: no error
    # One more word -> vocab size 15 vs 16 and a different vocab hash; pad "</s>" -> id 3.
    other = make_tokenizer(extra="seven", pad="</s>")
    other.padding_side = "left"
    with pytest.raises(TokenizerMismatch) as err:
        check_tokenizers_match(base, other)
    message = str(err.value)
    assert f"vocab_size: policy={len(base)} reference={len(base) + 1}" in message
    assert "vocab_sha256" in message
    assert "pad_token_id: policy=0 reference=3" in message
    assert "padding_side: policy='right' reference='left'" in message
    assert "bos_token_id" not in message and "eos_token_id" not in message
    assert "re-snapshot" in message


def test_state_dict_bytes_round_trip_with_tied_weights():
    model = make_model(12, tie=True)
    data = state_dict_bytes(model, metadata={"policy_version": "3"})
    restored = load_state_dict_from_safetensors(data)
    target = make_model(12, tie=True)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    target.load_state_dict(restored)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(target(ids).logits, model(ids).logits)
