"""The learner's forward with each distinct prompt computed once for all its samples.

A GRPO batch holds `group_size` samples of every prompt, and a row is its prompt followed by
its response, so a forward over the rows computes each prompt `group_size` times: on the
demo (8 samples of prompts of about 6 tokens, responses of at most 8) that is about half of
the positions the learner computes. Here the distinct prompts go through the model once, keeping every layer's keys and
values, and the responses attend to their prompt's keys and values (gathered per row, so
their gradients add up over the prompt's samples). The hidden states that predict the
response tokens, and so the logprobs, entropies and gradients, equal those of the whole rows
up to float rounding (tests/unit/test_prefix.py). Positions that predict padding hold
zeros here (`token_logprobs` does not take them through the head on either path).

The response pass runs the decoder layers' modules one by one, as `engines.hf.StaticDecoder`
does for decoding, so it knows the Llama family's layer structure only (`supports`); any
other model, or a layer set up for dropout in attention or a sliding window, takes the
whole-row forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

ARCHITECTURES = ("llama",)
"""`config.model_type`s whose decoder layers `response_pass` knows."""


def supports(model: nn.Module) -> bool:
    """Whether `model` (a causal LM) can take the shared-prompt forward."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in ARCHITECTURES
            and not getattr(config, "sliding_window", None)
            and not getattr(config, "attention_dropout", 0.0)
            and not _checkpointing(model))


def _checkpointing(model: nn.Module) -> bool:
    """Whether the model recomputes its layers in the backward pass (which the response
    pass, calling the layers' modules itself, would not do)."""
    name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    return bool(getattr(model, name, False))


def _in_prompt(response_start: Tensor) -> Tensor:
    """(B, P) True on each row's prompt tokens, P the longest prompt."""
    width = int(response_start.max())
    return torch.arange(width, device=response_start.device)[None, :] < response_start[:, None]


def right_padded(attention_mask: Tensor, response_start: Tensor) -> bool:
    """Whether every row starts with its whole prompt (no padding before the response)."""
    inside = _in_prompt(response_start)
    return bool((attention_mask[:, : inside.shape[1]].bool() | ~inside).all())


def distinct_prompts(input_ids: Tensor, response_start: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct prompts of right-padded rows: (prompts (U, P) with 0 past each prompt's
    end, their lengths (U,), and each row's prompt index (B,))."""
    inside = _in_prompt(response_start)
    keyed = torch.where(inside, input_ids[:, : inside.shape[1]], -1)  # (B, P): -1 past it
    unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)  # (U, P), (B,)
    lengths = (unique >= 0).sum(dim=1)  # (U,)
    return unique.clamp(min=0), lengths, inverse


def shared_prompt_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                         response_start: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """The final hidden states (B, T, H) that predict the response tokens at `index` (B, T)
    (clamped into the row; `valid` where not, see `heads.response_index`): position t of
    row i is the state at token index[i, t] - 1.

    Rows are right padded and each starts with its prompt; response_start (B,) >= 1."""
    base = model.base_model
    prompts, lengths, inverse = distinct_prompts(input_ids, response_start)
    prompt_mask = (torch.arange(prompts.shape[1], device=prompts.device)[None, :]
                   < lengths[:, None]).long()  # (U, P)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    out = base(input_ids=prompts, attention_mask=prompt_mask, position_ids=positions,
               use_cache=True)
    hidden = out.last_hidden_state  # (U, P, H)
    last = hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))
    first = last.index_select(0, inverse)  # (B, 1, H): predicts response token 0
    width = index.shape[1]
    # response tokens 0 .. n-2 predict tokens 1 .. n-1, n the longest response: the positions
    # past it (T is counted from the shortest prompt) predict padding, and get zeros
    longest = int((attention_mask.sum(dim=1) - response_start).max())
    needed = min(width, max(longest, 1)) - 1
    parts = [first]
    if needed > 0:
        tokens = index[:, :needed]  # (B, n-1)
        # a token counts when the token after it is real: a row's last one predicts padding
        after = slice(1, needed + 1)
        keep = attention_mask.gather(1, index[:, after]).bool() & valid[:, after]
        parts.append(response_pass(base, _cache(out), inverse, prompt_mask,
                                   input_ids.gather(1, tokens), keep,
                                   lengths.index_select(0, inverse)))
    if needed + 1 < width:
        parts.append(first.new_zeros((first.shape[0], width - needed - 1, first.shape[-1])))
    return torch.cat(parts, dim=1)


def _cache(out):
    """The key/value cache of a transformers model output (named `cache` in newer versions)."""
    fields = out.keys() if hasattr(out, "keys") else ()
    return out["cache"] if "cache" in fields else out["past_key_values"]


def response_pass(base: nn.Module, cache, inverse: Tensor, prompt_mask: Tensor,
                  tokens: Tensor, keep: Tensor, prompt_lengths: Tensor) -> Tensor:
    """Decoder layers over the response tokens (B, R) of each row, attending to its prompt's
    cached keys and values (U rows, gathered by `inverse`) and causally to each other; `keep`
    (B, R) marks the tokens to compute (a prefix of each row). Returns the final hidden states
    (B, R, H), after the norm, and zeros where `keep` is False.

    Only attention needs the rows' (B, R) layout. The position-wise modules (norms,
    projections, the MLP: most of the work) run on the N real tokens packed together, not
    on the padding after each row's response, nor on a row's last token (it predicts padding).
    On the demo's batches (responses of about 5.5 tokens in 7 to 8 positions) an update took
    15% less CPU on early batches of 224-296 rows and 6-7% less on late ones of 48-136."""
    config = base.config
    batch, width = tokens.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    real = keep.nonzero(as_tuple=True)  # ((N,), (N,)): row and position of each real token
    x = base.embed_tokens(tokens[real])  # (N, H)
    steps = torch.arange(width, device=tokens.device)
    cos, sin = base.rotary_emb(x, prompt_lengths[:, None] + steps[None, :])  # (B, R, D)
    causal = steps[None, :] <= steps[:, None]  # (R, R): query row, key column
    allowed = torch.cat([prompt_mask.bool().index_select(0, inverse)[:, None, :]
                         .expand(-1, width, -1),
                         causal[None] & keep[:, None, :]], dim=-1)  # (B, R, P + R)
    mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
        ~allowed, torch.finfo(x.dtype).min)[:, None]  # (B, 1, R, P + R), additive

    def rows(packed: Tensor, n: int) -> Tensor:
        """(N, n * D) packed per token -> (B, n, R, D), zeros at padding."""
        out = packed.new_zeros((batch, width, packed.shape[-1])).index_put(real, packed)
        return out.view(batch, width, n, head_dim).transpose(1, 2)

    for layer, cached in zip(base.layers, cache.layers, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)  # (N, H)
        q = rows(attn.q_proj(h), heads)  # (B, heads, R, D)
        k, v = rows(attn.k_proj(h), kv_heads), rows(attn.v_proj(h), kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = torch.cat([cached.keys.index_select(0, inverse), k], dim=2)  # (B, H_kv, P+R, D)
        values = torch.cat([cached.values.index_select(0, inverse), v], dim=2)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                           scale=attn.scaling, enable_gqa=heads != kv_heads)
        o = o.transpose(1, 2).reshape(batch, width, heads * head_dim)[real]  # (N, heads * D)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = base.norm(x)  # (N, H)
    return x.new_zeros((batch, width, x.shape[-1])).index_put(real, x)
