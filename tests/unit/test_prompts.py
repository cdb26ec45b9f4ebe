"""`task.prompt_format`: raw and chat prompts, SFT pairs, config errors, and tokenizers whose
pad token is their EOS token."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardrl.config import ConfigError, validate
from shardrl.engines.hf import HFEngine
from shardrl.models.io import load_tokenizer
from shardrl.stages.batch import build_batch
from shardrl.stages.sft import _batch, encode_pairs
from shardrl.tasks.prompts import PromptFormat, PromptFormatError
from shardrl.tasks.source import make_task
from shardrl.tasks.verifiers import math_final_answer

SPECIALS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]  # ids 0..3; <|im_end|> is the EOS
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789+=.:? \n")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
IM_START, IM_END, BOS = 2, 3, 1


def char_ids(text: str) -> list[int]:
    return [len(SPECIALS) + CHARS.index(c) for c in text]


def chat_tokenizer(pad: str = "<|im_end|>", template: str | None = CHAT_TEMPLATE):
    """A character tokenizer that prepends <s> (as many do) and has a chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                 pad_token=pad, additional_special_tokens=SPECIALS[2:])
    hf.chat_template = template
    return hf


def test_raw_prompts_are_tokenized_as_is():
    tok = chat_tokenizer()
    assert PromptFormat("raw").text(tok, "1+2=") == "1+2="
    assert PromptFormat("raw").encode(tok, ["1+2=", "9="]) == [[BOS] + char_ids("1+2="),
                                                               [BOS] + char_ids("9=")]


def test_chat_prompts_use_the_template_without_extra_special_tokens():
    tok = chat_tokenizer()
    fmt = PromptFormat("chat")
    assert fmt.text(tok, "1+2=") == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    # no <s> in front: the template's text carries every special token the model expects
    assert fmt.encode(tok, ["1+2="]) == [[IM_START, *char_ids("user\n1+2="), IM_END,
                                          *char_ids("\n"), IM_START, *char_ids("assistant\n")]]
    system = PromptFormat("chat", "be brief.")
    assert system.text(tok, "9=") == ("<|im_start|>system\nbe brief.<|im_end|>\n"
                                      "<|im_start|>user\n9=<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.encode(tok, []) == []


def test_sft_targets_follow_the_formatted_prompt():
    tok = chat_tokenizer()
    fmt = PromptFormat("chat")
    prompt_ids = fmt.encode(tok, ["1+2="])[0]
    [(ids, start)] = encode_pairs(tok, [("1+2=", "3")], fmt)
    assert start == len(prompt_ids) == 1 + 9 + 1 + 1 + 1 + 10
    assert ids == prompt_ids + char_ids("3") + [IM_END]
    # raw by default: <s> prompt answer eos, the answer after the prompt's own tokens
    [(ids, start)] = encode_pairs(tok, [("1+2=", "3")])
    assert (ids, start) == ([BOS, *char_ids("1+2=3"), IM_END], 5)
    # pad == eos: the final EOS is a target, the padding after a shorter row is not
    input_ids, attn, labels = _batch([(ids, start), ([BOS, *char_ids("9=12"), IM_END], 3)],
                                     tok.pad_token_id)
    assert labels[0].tolist() == [-100] * 5 + [char_ids("3")[0], IM_END]
    assert labels[1].tolist() == [-100] * 3 + char_ids("12") + [IM_END, -100]
    assert attn[1].tolist() == [1] * 6 + [0]
    assert input_ids[1, -1].item() == IM_END  # the pad id, masked


def test_chat_needs_a_template():
    tok = chat_tokenizer(template=None)
    with pytest.raises(PromptFormatError, match="no chat template"):
        PromptFormat("chat").encode(tok, ["1+2="])
    PromptFormat("raw").check(tok)  # raw needs none


def test_config_errors_for_chat():
    with pytest.raises(ConfigError, match="tiny model's character tokenizer has none"):
        validate({"task": {"prompt_format": "chat"}}, "test")
    with pytest.raises(ConfigError, match="system_prompt is set but task.prompt_format is 'raw'"):
        validate({"task": {"system_prompt": "be brief."}}, "test")
    cfg = validate({"model": {"source": {"kind": "pretrained", "path": "m"}},
                    "task": {"prompt_format": "chat", "system_prompt": "be brief."}}, "test")
    assert PromptFormat.from_config(cfg) == PromptFormat("chat", "be brief.")


def test_chat_tasks_check_the_stated_answer():
    raw = validate({"task": {"source": {"kind": "builtin", "name": "addition"}}}, "test")
    chat = validate({"model": {"source": {"kind": "pretrained", "path": "m"}},
                     "task": {"source": {"kind": "builtin", "name": "addition"},
                              "prompt_format": "chat"}}, "test")
    assert make_task(raw).verify("17 + 25 = 42.", "42") == 0.0  # raw: the exact answer only
    assert make_task(raw).verify("42", "42") == 1.0
    assert make_task(chat).verify is math_final_answer
    assert make_task(chat).verify("17 + 25 = 42.", "42") == 1.0


def test_tokenizer_without_pad_pads_with_eos(tmp_path):
    tok = chat_tokenizer(pad=None)
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert (loaded.pad_token, loaded.pad_token_id, loaded.eos_token_id) == ("<|im_end|>", 3, 3)
    assert loaded.chat_template == CHAT_TEMPLATE


def _model(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_generation_with_pad_equal_to_eos():
    """Pad is only ever written where a mask or a length says so: the same samples whether
    the pad id is the EOS id or another token, each ending at its first EOS."""
    model = _model(6)
    eos = 5
    prompts = [[1, 2, 3, 4], [2], [3, 1]]  # different lengths: the batch is left-padded
    runs = [HFEngine(model, eos_token_id=eos, pad_token_id=pad).generate(
        prompts, 8, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3) for pad in (eos, 0)]
    same_pad, other_pad = ([s for g in run for s in g] for run in runs)
    assert [s.token_ids for s in same_pad] == [s.token_ids for s in other_pad]
    assert [s.finish_reason for s in same_pad] == [s.finish_reason for s in other_pad]
    for a, b in zip(same_pad, other_pad, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    stopped = [s for s in same_pad if s.finish_reason == "stop"]
    cut = [s for s in same_pad if s.finish_reason == "length"]
    assert stopped and cut  # both kinds occur with this seed
    for s in stopped:  # the EOS is the response's last token, and its only one
        assert s.token_ids[-1] == eos and s.token_ids.count(eos) == 1
        assert len(s.logprobs) == len(s.token_ids) and s.logprobs[-1] < 0
    for s in cut:
        assert len(s.token_ids) == 6 and eos not in s.token_ids


def test_learner_batch_with_pad_equal_to_eos():
    """A response ending in EOS keeps the EOS as a trained token; padding stays masked."""
    eos = 3
    table = pa.table({"prompt_token_ids": [[1, 7, 8], [1, 9]],
                      "response_token_ids": [[4, 5, eos], [6]]})
    batch = build_batch(table, pad_id=eos)
    assert batch.input_ids.tolist() == [[1, 7, 8, 4, 5, eos], [1, 9, 6, eos, eos, eos]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.response_start.tolist() == [3, 2]
    assert batch.response_lengths.tolist() == [3, 1]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
