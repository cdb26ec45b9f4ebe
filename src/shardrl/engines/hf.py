"""Generation with a transformers causal LM: batched, KV-cached, stopping per row on eos.

The prompts are prefilled once, as one left-padded batch, and their cache repeated for the
`n` samples of each; then all samples decode as one batch. Each decoding step is one forward
over the newest token per row with the model's key/value cache; the
sampling, the stop bookkeeping and the behaviour log-probabilities are whole-batch tensor
operations, so there is no per-row Python work inside the loop.

For Llama-family models (the demo's tiny model, SmolLM2) a decoding step runs the model's own
modules over a key/value cache allocated once for the whole generation (`StaticDecoder`)
instead of the model's forward, whose cache grows by concatenation and whose per-call set-up
(masks, output objects) took most of a small batch's time on a CPU. Its attention is the
model's eager attention written out, so it samples the same tokens with the same
log-probabilities (within float32 rounding: its keys come in blocks of 16 and it sums the
values as a multiply-add, see `StaticDecoder`); any other architecture decodes through the
model's forward.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shardrl.engines.base import Sample
from shardrl.models.prefix import key_width


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the sampling distribution, in float32.

    logits: (B, V). Returns (B, V): log_softmax(logits / temperature), and when `top_p < 1`
    the tokens outside the nucleus (the smallest set of most likely tokens whose probability
    reaches `top_p`; the most likely token is always kept) get -inf and the rest are
    renormalised.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)  # (B, V)
    mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()  # (B, V)
    drop_sorted = mass_before >= top_p  # (B, V); position 0 has mass_before 0, always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


class StaticDecoder:
    """Decoding steps of a Llama-family model over a preallocated key/value cache.

    Built from the prefill's cache: layer l's keys and values go into buffers of shape
    (B, H_kv, T + max_new_tokens, D), repeated for the `n` samples of each prompt, and each
    step writes its one new position in place. A step is the decoder layer's computation
    (`input_layernorm`, q/k/v projections, rotary embedding, attention over the cache,
    `o_proj`, `post_attention_layernorm`, `mlp`) through the model's own modules, so LoRA or
    other wrapped projections compute as in the model's forward; the attention is the eager
    one (scores in the model's dtype, the padding mask added, softmax in float32), grouped
    query attention included. Without grouped heads (one query head per key/value head) the
    weighted sum of the values is a multiply and a sum rather than a batched matrix product:
    each row's product is a (1, L) x (L, D) one, which a batched GEMM runs a matrix at a time;
    at the demo's size that took a sixth of a generation, the multiply-add a third of that.
    """

    ARCHITECTURES = ("llama",)
    """`config.model_type`s whose decoder layers have exactly that structure."""

    def __init__(self, base: torch.nn.Module, prefill_cache, attention: torch.Tensor, n: int,
                 max_new_tokens: int) -> None:
        config = base.config
        self.base = base
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads  # query heads per key/value head
        self.scaling = self.head_dim ** -0.5
        prompts, width = attention.shape
        self.batch = prompts * n
        # positions in whole blocks (`models.prefix.KEY_BLOCK`), the unwritten ones zeros, masked
        capacity = key_width(width + max_new_tokens)
        self.keys: list[torch.Tensor] = []  # per layer (B, H_kv, capacity, D)
        self.values: list[torch.Tensor] = []
        for layer in prefill_cache.layers:
            for prefilled, out in ((layer.keys, self.keys), (layer.values, self.values)):
                buffer = prefilled.new_zeros((self.batch, self.kv_heads, capacity,
                                              self.head_dim))
                buffer[:, :, :width] = prefilled.repeat_interleave(n, dim=0)
                out.append(buffer)
        dtype = self.keys[0].dtype
        keep = torch.zeros((self.batch, capacity), dtype=torch.bool, device=attention.device)
        keep[:, :width] = attention.repeat_interleave(n, dim=0).bool()  # prompt padding off
        self.mask = torch.zeros(keep.shape, dtype=dtype, device=attention.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None, None, :]  # (B, 1, 1, capacity), additive
        """0 on the positions each row attends to: its prompt and what was decoded so far."""
        self.written = width  # cache positions filled

    @classmethod
    def supports(cls, model: PreTrainedModel, cache) -> bool:
        """Whether `model`'s decoder layers and the prefill's cache are of the known kind."""
        config = model.config
        layers = getattr(cache, "layers", None)
        return (getattr(config, "model_type", None) in cls.ARCHITECTURES
                and not getattr(config, "sliding_window", None)
                and layers is not None and len(layers) == config.num_hidden_layers
                and all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers))

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (B,) at positions (B, 1) -> the last hidden state (B, H) after the final norm."""
        base, batch = self.base, self.batch
        x = base.embed_tokens(tokens[:, None])  # (B, 1, H)
        cos, sin = base.rotary_emb(x, positions)
        at, seen = self.written, self.written + 1
        self.mask[..., at] = 0.0  # the position this step writes
        # the keys through it, in whole blocks (at the demo's size a step's attention took
        # 148 us against 201-241 us on 9-13 keys, 128 rows, 4 heads)
        seen = key_width(seen)
        mask = self.mask[..., :seen]  # (B, 1, 1, L)
        for layer, keys, values in zip(base.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, 1, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # (B, heads, 1, D), (B, H_kv, 1, D)
            keys[:, :, at:at + 1] = k
            values[:, :, at:at + 1] = v
            # query heads grouped by the key/value head they share: (B, H_kv, G, D)
            q = q.reshape(batch, self.kv_heads, self.groups, self.head_dim)
            scores = torch.matmul(q, keys[:, :, :seen].transpose(2, 3)) * self.scaling + mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            if self.groups == 1:  # a batch of vector-matrix products: as one multiply-add
                out = (weights.transpose(2, 3) * values[:, :, :seen]).sum(2, keepdim=True)
            else:
                out = torch.matmul(weights, values[:, :, :seen])  # (B, H_kv, G, D)
            x = x + attn.o_proj(out.reshape(batch, 1, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.written = at + 1
        return base.norm(x)[:, -1]


class HFEngine:
    """The `Engine` implementation on a transformers `PreTrainedModel` (CPU or GPU).

    `fp32_lm_head=True` computes the logits with the output head in float32 whatever the
    model's dtype, as the learner does, so behaviour and learner log-probabilities agree.
    `temperature=0` means greedy decoding; the sampling distribution is then a point mass
    and every behaviour log-probability is 0.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_id: int,
        pad_token_id: int,
        fp32_lm_head: bool = True,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.fp32_lm_head = fp32_lm_head
        self.version = version
        self._state_targets: dict[str, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict_or_dir: dict[str, torch.Tensor] | str | Path,
                     version: int) -> None:
        """Copy new weights into the model in place and set `version`.

        Accepts a state dict or a directory of `*.safetensors` files. Missing keys are only
        allowed for tied weights (the output head of a model with tied embeddings).
        """
        if isinstance(state_dict_or_dir, dict):
            state_dict = state_dict_or_dir
        else:
            files = sorted(Path(state_dict_or_dir).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {state_dict_or_dir}")
            state_dict = {}
            for f in files:
                state_dict.update(load_file(str(f)))
        targets = self._targets()
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if self.model.config.tie_word_embeddings:
            tied.add("lm_head.weight")
        missing = [k for k in targets if k not in state_dict and k not in tied]
        unexpected = [k for k in state_dict if k not in targets]
        if missing or unexpected:
            raise KeyError(
                f"weights do not match the model: missing {missing}, unexpected {unexpected}"
            )
        mismatched = [f"{k}: {tuple(t.shape)} into {tuple(targets[k].shape)}"
                      for k, t in state_dict.items() if t.shape != targets[k].shape]
        if mismatched:
            raise ValueError(f"weights do not match the model's shapes: {', '.join(mismatched)}")
        with torch.no_grad():
            for key, tensor in state_dict.items():
                targets[key].copy_(tensor)
        self.version = version

    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's parameters and persistent buffers by state-dict name, the tensors the
        weights are copied into. Built once: `Module.load_state_dict` walks every module and
        its hooks on each call, several times what copying a small model's tensors costs,
        and a rollout worker loads every published version."""
        if self._state_targets is None:
            self._state_targets = dict(self.model.state_dict(keep_vars=True))
        return self._state_targets

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (B, H) -> logits (B, V), float32 (head in float32 when `fp32_lm_head`)."""
        head = self.model.get_output_embeddings()
        if self.fp32_lm_head:
            bias = None if head.bias is None else head.bias.float()
            return F.linear(hidden.float(), head.weight.float(), bias)
        return head(hidden).float()

    @torch.inference_mode()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
    ) -> list[list[Sample]]:
        """Sample `n` responses per prompt; see `Engine.generate`.

        The prompts are prefilled once each; their key/value cache and last hidden state are
        then repeated for the `n` samples (a group's samples share their prompt, and the
        prefill was most of a short generation's cost when run on every sample's copy).
        """
        device = self.device
        width = max(len(p) for p in prompt_token_ids)
        batch = len(prompt_token_ids) * n
        prompt_ids = torch.full((len(prompt_token_ids), width), self.pad_token_id,
                                dtype=torch.long)  # (P, T)
        attention = torch.zeros((len(prompt_token_ids), width), dtype=torch.long)  # (P, T)
        for i, p in enumerate(prompt_token_ids):  # left padding
            prompt_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        prompt_ids, attention = prompt_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (P, T)
        generator = torch.Generator(device=device).manual_seed(seed)

        out = self.model.base_model(input_ids=prompt_ids, attention_mask=attention,
                                    position_ids=positions, use_cache=True)
        cache = out.cache
        hidden = out.last_hidden_state[:, -1]  # (P, H)
        # row i * n + j is sample j of prompt i
        decoder = None
        if StaticDecoder.supports(self.model, cache):
            decoder = StaticDecoder(self.model.base_model, cache, attention, n, max_new_tokens)
        elif n > 1:
            cache.batch_repeat_interleave(n)
            attention = attention.repeat_interleave(n, dim=0)  # (B, T)
        hidden = hidden.repeat_interleave(n, dim=0)  # (B, H)
        step_pos = positions[:, -1:].repeat_interleave(n, dim=0)  # (B, 1)

        tokens = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long,
                            device=device)  # (B, N)
        logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
        for t in range(max_new_tokens):
            logits = self._logits(hidden)  # (B, V)
            if temperature <= 0:
                tok = logits.argmax(-1)  # (B,)
                tok_logp = torch.zeros(batch, device=device)
            else:
                logp = sampling_logprobs(logits, temperature, top_p)  # (B, V)
                tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
                tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1)  # (B,)
            tok = tok.masked_fill(done, self.pad_token_id)
            tokens[:, t] = tok
            logprobs[:, t] = tok_logp.masked_fill(done, 0.0)
            done = done | (tok == self.eos_token_id)
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            step_pos = step_pos + 1  # (B, 1)
            if decoder is not None:
                hidden = decoder.step(tok, step_pos)  # (B, H)
                continue
            attention = torch.cat([attention, attention.new_ones((batch, 1))], dim=-1)
            out = self.model.base_model(input_ids=tok[:, None], attention_mask=attention,
                                        position_ids=step_pos, cache=cache, use_cache=True)
            cache = out.cache
            hidden = out.last_hidden_state[:, -1]  # (B, H)

        is_eos = tokens == self.eos_token_id  # (B, N)
        has_eos = is_eos.any(-1)  # (B,)
        lengths = torch.where(has_eos, is_eos.int().argmax(-1) + 1,
                              torch.full_like(has_eos, max_new_tokens, dtype=torch.long))
        tok_list, lp_list = tokens.tolist(), logprobs.tolist()
        len_list, eos_list = lengths.tolist(), has_eos.tolist()
        samples = [
            Sample(token_ids=tok_list[i][: len_list[i]], logprobs=lp_list[i][: len_list[i]],
                   finish_reason="stop" if eos_list[i] else "length")
            for i in range(batch)
        ]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]
