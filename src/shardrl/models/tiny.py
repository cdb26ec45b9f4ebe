"""A locally trained character-level tokenizer and a tiny Llama-style model.

Nothing here downloads anything: the tokenizer is trained on the texts it is given with the
`tokenizers` library, and the model is randomly initialised from a `LlamaConfig`. Both are
small enough to train and sample on a couple of CPU cores in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def train_tokenizer(texts: Iterable[str], out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train a character-level tokenizer on `texts` and save it to `out_dir`.

    Every character seen in `texts` becomes one token (ids after the four special tokens
    `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3); unseen characters map to `<unk>`. Encoding
    prepends `<s>`; `</s>` is appended by the caller where a sequence ends. Because tokens
    are single characters, `encode(prompt + answer)` equals `encode(prompt) + chars(answer)`,
    which keeps prompt/response boundaries exact.

    Padding side is right (for training batches); set `tokenizer.padding_side = "left"`
    for generation batches.
    """
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
    )
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
) -> LlamaForCausalLM:
    """Randomly initialise a Llama-style causal LM sized for `tokenizer`'s vocabulary.

    Input and output embeddings are tied (at these sizes the embedding matrices would
    otherwise be a large share of the parameters). Same `seed` gives the same weights.
    """
    return tiny_lm(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        seed=seed,
    )


def tiny_lm(*, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int,
            hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
            max_position_embeddings: int, seed: int) -> LlamaForCausalLM:
    """`build_tiny_model` from the vocabulary's size and special ids alone."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model
