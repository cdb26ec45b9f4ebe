"""The learner's forward with each distinct prompt computed once for all its samples.

A GRPO batch holds `group_size` samples of every prompt, and a row is its prompt followed by
its response, so a forward over the rows computes each prompt `group_size` times: on the
demo (8 samples of prompts of about 6 tokens, responses of at most 8) that is about half of
the positions the learner computes. Here each distinct prompt is computed once, and the
responses attend to their prompt's keys and values (gathered per row, so their gradients add
up over the prompt's samples). The hidden states that predict the response tokens, and so
the logprobs, entropies and gradients, equal those of the whole rows up to float rounding
(tests/unit/test_prefix.py). Positions that predict padding hold zeros here
(`token_logprobs` does not take them through the head on either path).

`joint_pass` runs the decoder layers' modules one by one, as `engines.hf.StaticDecoder` does
for decoding, so it knows the Llama family's layer structure only (`supports`); any other
model, or a layer set up for dropout in attention or a sliding window, takes the whole-row
forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

ARCHITECTURES = ("llama",)
"""`config.model_type`s whose decoder layers `joint_pass` knows."""


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
                   < lengths[:, None])  # (U, P)
    width = index.shape[1]
    # response tokens 0 .. n-2 predict tokens 1 .. n-1, n the longest response: the positions
    # past it (T is counted from the shortest prompt) predict padding, and get zeros
    longest = int((attention_mask.sum(dim=1) - response_start).max())
    needed = max(min(width, max(longest, 1)) - 1, 0)
    tokens = input_ids.gather(1, index[:, :needed])  # (B, n-1)
    # a token counts when the token after it is real: a row's last one predicts padding
    after = slice(1, needed + 1)
    keep = attention_mask.gather(1, index[:, after]).bool() & valid[:, after]  # (B, n-1)
    last, responses = joint_pass(base, prompts, prompt_mask, inverse, tokens, keep)
    parts = [last.index_select(0, inverse)[:, None]]  # (B, 1, H): predicts response token 0
    if needed > 0:
        parts.append(responses)
    if needed + 1 < width:
        parts.append(last.new_zeros((len(inverse), width - needed - 1, last.shape[-1])))
    return torch.cat(parts, dim=1)


def joint_pass(base: nn.Module, prompts: Tensor, prompt_mask: Tensor, inverse: Tensor,
               tokens: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """The decoder over the distinct prompts (U, P; `prompt_mask` marks their tokens) and
    the rows' response tokens (B, R; `keep` marks the ones to compute, a prefix of each row)
    in one pass. Each response attends to its prompt's keys and values (prompt `inverse[i]`
    for row i, gathered, so their gradients add up over the prompt's samples) and causally
    to its own tokens; a prompt attends causally to itself.

    Returns the final hidden states, after the norm, of each prompt's last token (U, H) and
    of the response tokens (B, R, H), zeros where `keep` is False.

    Only attention needs the (rows, positions) layout. The position-wise modules (norms,
    projections, the MLP: most of the work) run once per layer on every real token of both
    kinds packed together: no padding, no row's last token (it predicts padding), and one
    call per module where the model's own forward over the prompts followed by a response
    pass made two. With `attend` and `KEY_BLOCK`, an update of the demo's batches of 128-240
    rows took 20% less CPU than with that prompt pass (30.1 ms against 37.7, one thread,
    medians of 7 interleaved repeats)."""
    config = base.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n_prompts, p_width = prompts.shape
    batch, r_width = tokens.shape
    lengths = prompt_mask.sum(dim=1)  # (U,)
    p_real = prompt_mask.nonzero(as_tuple=True)  # ((Np,), (Np,)), prompt by prompt
    r_real = keep.nonzero(as_tuple=True)  # ((Nr,), (Nr,))
    n_p = len(p_real[0])
    x = base.embed_tokens(torch.cat([prompts[p_real], tokens[r_real]]))  # (N, H)
    positions = torch.cat([p_real[1], lengths.index_select(0, inverse)[r_real[0]] + r_real[1]])
    cos, sin = base.rotary_emb(x, positions[None])  # (1, N, D)
    cos, sin = cos[0], sin[0]  # (N, D)
    lowest = torch.finfo(x.dtype).min
    # key positions in multiples of KEY_BLOCK, the padding masked out (see KEY_BLOCK)
    p_keys, r_keys = key_width(p_width), key_width(p_width + r_width)
    p_steps = torch.arange(p_keys, device=x.device)
    p_allowed = ((p_steps[None, :] <= p_steps[:, None])[None]
                 & F.pad(prompt_mask, (0, p_keys - p_width))[:, None, :])  # (U, P', P')
    p_bias = x.new_zeros(p_allowed.shape).masked_fill(~p_allowed, lowest)[:, None]
    r_steps = torch.arange(r_width, device=x.device)
    r_allowed = torch.cat([prompt_mask.index_select(0, inverse)[:, None, :]
                           .expand(-1, r_width, -1),
                           (r_steps[None, :] <= r_steps[:, None])[None] & keep[:, None, :]],
                          dim=-1)  # (B, R, P + R): query row, key column
    r_allowed = F.pad(r_allowed, (0, r_keys - p_width - r_width))  # (B, R, K')
    r_bias = x.new_zeros(r_allowed.shape).masked_fill(~r_allowed, lowest)[:, None]

    def rows(packed: Tensor, real: tuple[Tensor, Tensor], n_rows: int, width: int,
             n: int) -> Tensor:
        """(M, n * D) packed per token -> (n_rows, n, width, D), zeros at padding."""
        out = packed.new_zeros((n_rows, width, packed.shape[-1])).index_put(real, packed)
        return out.view(n_rows, width, n, head_dim).transpose(1, 2)

    def packed(o: Tensor, real: tuple[Tensor, Tensor]) -> Tensor:
        """(rows, heads, width, D) -> (M, heads * D) at the real positions."""
        return o.transpose(1, 2).flatten(2)[real]

    def response_keys(prompt: Tensor, response: Tensor) -> Tensor:
        """Each row's prompt keys (or values), its response's and zeros: (B, kv_heads, K', D)."""
        tail = response.new_zeros((*response.shape[:2], r_keys - p_width - r_width,
                                   head_dim))
        return torch.cat([prompt[:, :, :p_width].index_select(0, inverse), response, tail],
                         dim=2)

    for layer in base.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)  # (N, H)
        q = attn.q_proj(h).view(-1, heads, head_dim)
        k = attn.k_proj(h).view(-1, kv_heads, head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # (N, heads, D), (N, kv_heads, D)
        q, k, v = q.flatten(1), k.flatten(1), attn.v_proj(h)
        qp, kp, vp = (rows(t[:n_p], p_real, n_prompts, p_keys, n)
                      for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
        o_p = attend(qp, kp, vp, p_bias, attn.scaling)  # (U, heads, P', D)
        qr, kr, vr = (rows(t[n_p:], r_real, batch, r_width, n)
                      for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
        o_r = attend(qr, response_keys(kp, kr), response_keys(vp, vr), r_bias, attn.scaling)
        x = x + attn.o_proj(torch.cat([packed(o_p, p_real), packed(o_r, r_real)]))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = base.norm(x)  # (N, H)
    last = x[lengths.cumsum(0) - 1]  # (U, H): tokens are packed prompt by prompt
    responses = x.new_zeros((batch, r_width, x.shape[-1])).index_put(r_real, x[n_p:])
    return last, responses


KEY_BLOCK = 16
"""The attention's key positions come in multiples of this, the extra ones masked out: torch's
CPU softmax over a last dimension that is not a multiple of 16 (the AVX-512 width) takes a
slow path, 1.7 ms against 0.14 for (240, 4, 7, 15) scores against (240, 4, 7, 16), and the
fused kernel slows down alike (forward and backward of the demo's response attention 4.9 ms
with 15 keys, 2.1 ms with 16)."""


def key_width(keys: int) -> int:
    """`keys` rounded up to a whole number of `KEY_BLOCK`s (decoding uses it too)."""
    return keys + (-keys % KEY_BLOCK)


SMALL_ATTENTION = 1 << 22
"""Most attention scores (rows x heads x queries x keys) `attend` computes as two matrix
products around a float32 softmax on CPU: on the demo's short rows that is about a third
cheaper than the fused kernel (forward and backward, 1.6 ms against 2.3 for 240 rows), and
past this size the fused kernel keeps the scores from being held whole."""


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Attention of q (rows, heads, Q, D) over k, v (rows, kv_heads, K, D) with the additive
    mask `bias` (rows, 1, Q, K); (rows, heads, Q, D)."""
    rows, heads, queries, _ = q.shape
    if not q.is_cpu or rows * heads * queries * k.shape[2] > SMALL_ATTENTION:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                              enable_gqa=heads != k.shape[1])
    if heads != k.shape[1]:  # grouped queries: each key/value head serves heads / kv_heads
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias  # (rows, heads, Q, K)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # as eager does
    return torch.matmul(weights, v)
