"""Model heads: per-token logprobs with an FP32 LM head, a value critic, a reward model.

Alignment convention (used by every function here): a row of `input_ids` (B, L) is a
prompt followed by a response; `response_start` is the index of the row's first response
token. Position t of a (B, T) output belongs to response token `response_start + t`, and
is predicted from the hidden state at `response_start + t - 1`. T = L - min(response_start);
positions past the end of a row (when rows start at different indices) are 0.

Position ids are derived from the attention mask (`cumsum - 1`), as generation does, so a
left-padded row gets the same logprobs as the same row without padding.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PreTrainedModel

from shardrl.models import prefix
from shardrl.models.io import check_safe_weights_dir, directory_manifest, loading_on_this_thread

CRITIC_WEIGHTS = "critic.safetensors"
VALUE_HEAD_INIT_STD = 1e-2


class TokenLogprobs(NamedTuple):
    """Per-response-token outputs of `token_logprobs`."""

    logprobs: Tensor  # (B, T) float32
    entropy: Tensor  # (B, T) float32
    logits: Tensor | None  # (B, T, V) float32, only when requested


class RewardModelError(ValueError):
    """A directory does not hold a usable scalar reward model."""


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, L) positions counting only attended tokens; pads get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_index(
    response_start: int | Tensor, batch: int, seq_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Token indices (B, T) of the response tokens (clamped into the row) and their validity."""
    starts = torch.as_tensor(response_start, device=device, dtype=torch.long).expand(batch)
    low, high = int(starts.min()), int(starts.max())
    if low < 1 or high > seq_len:
        raise ValueError(f"response_start must lie in [1, {seq_len}], got [{low}, {high}]")
    steps = torch.arange(seq_len - low, device=device)  # (T,)
    index = starts[:, None] + steps[None, :]  # (B, T)
    valid = index < seq_len  # (B, T)
    return index.clamp(max=seq_len - 1), valid


def _final_hidden(backbone: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state  # (B, L, H)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int | Tensor,
    temperature: float = 1.0,
    fp32_lm_head: bool = True,
    return_logits: bool = False,
    chunk: int | None = None,
    share_prompts: bool = False,
) -> TokenLogprobs:
    """Logprobs and entropies of the response tokens under `model` at `temperature`.

    input_ids, attention_mask: (B, L); response_start: int or (B,).
    Only the hidden states that predict real response tokens go through the LM head (the
    padding after a row's response holds 0; with a vocabulary of tens of thousands the head
    and its softmax are a large part of an update, and of its memory). With
    `fp32_lm_head` the head runs in float32 (hidden states and weight upcast), which keeps
    logprobs of a bf16 model close to the generator's; otherwise the head runs in the
    model's dtype and only the softmax is float32. Assumes a plain linear head
    (Llama/Qwen/Mistral style, no logit soft-capping).

    `chunk` (response positions per row) computes the head, softmax, logprobs and entropies
    on B x `chunk` positions at a time, so the float32 logits never exist whole: with
    gradients on, each chunk is recomputed in the backward pass instead of being kept
    (activation checkpointing), so the head's activations take (B x chunk, V). The results
    equal the unchunked ones up to float error; `return_logits` needs the whole (B, T, V)
    tensor (no chunking, every position through the head).

    `share_prompts` computes each distinct prompt once for all the rows that start with it
    (`models.prefix`), with the same results up to float error; other models than the Llama
    family's, and left-padded rows, take the whole rows.
    """
    batch, seq_len = input_ids.shape
    index, valid = response_index(response_start, batch, seq_len, input_ids.device)
    starts = (torch.as_tensor(response_start, device=input_ids.device).expand(batch)
              if share_prompts and prefix.supports(model) else None)
    if starts is not None and prefix.right_padded(attention_mask, starts):
        pred = prefix.shared_prompt_hidden(model, input_ids, attention_mask, starts, index,
                                           valid)
    else:
        hidden = _final_hidden(model.base_model, input_ids, attention_mask)  # (B, L, H)
        pred = hidden.gather(1, (index - 1)[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    head = model.get_output_embeddings()
    targets = input_ids.gather(1, index)  # (B, T)
    if return_logits:
        zero = torch.zeros((), dtype=torch.float32, device=pred.device)
        logprobs, entropy, logits = _head_logprobs(head, pred, targets, temperature, fp32_lm_head)
        return TokenLogprobs(logprobs=torch.where(valid, logprobs, zero),
                             entropy=torch.where(valid, entropy, zero), logits=logits)
    # the head only where the target is a real token: not past a row's end nor on padding
    real = (valid & attention_mask.gather(1, index).bool()).nonzero(as_tuple=True)  # (N,) x 2
    flat, flat_targets = pred[real][None], targets[real][None]  # (1, N, H), (1, N)
    positions = flat.shape[1]
    per_chunk = None if chunk is None else chunk * batch  # as many logits as B rows x chunk
    if per_chunk is None or per_chunk >= positions:
        logprobs, entropy, _ = _head_logprobs(head, flat, flat_targets, temperature,
                                              fp32_lm_head, False)
    else:
        parts = []
        for first in range(0, positions, per_chunk):
            args = (head, flat[:, first:first + per_chunk],
                    flat_targets[:, first:first + per_chunk], temperature, fp32_lm_head, False)
            if torch.is_grad_enabled():
                parts.append(checkpoint(_head_logprobs, *args, use_reentrant=False))
            else:
                parts.append(_head_logprobs(*args))
        logprobs = torch.cat([p[0] for p in parts], dim=1)  # (1, N)
        entropy = torch.cat([p[1] for p in parts], dim=1)  # (1, N)
    out = torch.zeros(targets.shape, dtype=torch.float32, device=pred.device)  # (B, T)
    return TokenLogprobs(logprobs=out.index_put(real, logprobs[0]),
                         entropy=out.index_put(real, entropy[0]), logits=None)


def _head_logprobs(head: nn.Module, pred: Tensor, targets: Tensor, temperature: float,
                   fp32_lm_head: bool, keep_logits: bool = True,
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
    """pred (B, t, H), targets (B, t) -> logprobs, entropy (B, t) float32 [, logits (B, t, V)]."""
    if fp32_lm_head:
        bias = None if head.bias is None else head.bias.float()
        logits = F.linear(pred.float(), head.weight.float(), bias)  # (B, t, V)
    else:
        logits = head(pred).float()  # (B, t, V)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (B, t, V)
    logprobs = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # (B, t)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, t)
    return logprobs, entropy, logits if keep_logits else None


def logits_chunk(batch: int, vocab: int, max_mb: float | None) -> int | None:
    """Response positions per chunk so that one chunk's float32 logits of a batch of `batch`
    rows over `vocab` tokens take at most `max_mb` MiB (None: no limit, no chunking)."""
    if max_mb is None:
        return None
    return max(1, int(max_mb * 2**20 // (4 * batch * vocab)))


class Critic(nn.Module):
    """Value model: a transformer backbone plus a float32 scalar head.

    Build it with `Critic.from_causal_lm(reference)` (a copy of the reference backbone, so
    the policy is untouched) and persist it with `save` / `Critic.load` (safetensors).
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, std=VALUE_HEAD_INIT_STD)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, lm: PreTrainedModel) -> Critic:
        """A critic whose backbone is a deep copy of `lm`'s backbone."""
        return cls(copy.deepcopy(lm.base_model))

    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) float32: value of the prefix ending at each token."""
        hidden = _final_hidden(self.backbone, input_ids, attention_mask)  # (B, L, H)
        return self.value_head(hidden.float()).squeeze(-1)  # (B, L)

    forward = values

    def response_values(
        self, input_ids: Tensor, attention_mask: Tensor, response_start: int | Tensor
    ) -> Tensor:
        """(B, T): value of the state before response token t (same alignment as logprobs)."""
        batch, seq_len = input_ids.shape
        index, valid = response_index(response_start, batch, seq_len, input_ids.device)
        values = self.values(input_ids, attention_mask).gather(1, index - 1)  # (B, T)
        return torch.where(valid, values, torch.zeros((), device=values.device))

    def save(self, out_dir: str | Path) -> dict[str, str]:
        """Write `config.json` and `critic.safetensors`; return the directory's manifest."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.config.save_pretrained(str(out))
        save_model(self, str(out / CRITIC_WEIGHTS))
        return directory_manifest(out)

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Critic:
        """Inverse of `save` (safetensors only; the value head stays float32)."""
        check_safe_weights_dir(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        critic = cls(AutoModel.from_config(config, dtype=dtype))
        load_model(critic, str(Path(model_dir) / CRITIC_WEIGHTS), strict=True)
        return critic


def load_reward_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Load a `*ForSequenceClassification` reward model with exactly one output, in eval mode.

    Raises `RewardModelError` for any other head (a causal LM, a multi-label classifier) and
    for a config without `pad_token_id` (needed to find each text's last token in a batch).
    """
    check_safe_weights_dir(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    archs = list(config.architectures or [])
    expected = "a *ForSequenceClassification model with num_labels=1 (one scalar score per text)"
    if not archs or not all(a.endswith("ForSequenceClassification") for a in archs):
        found = ", ".join(archs) if archs else "no `architectures` in config.json"
        raise RewardModelError(f"{model_dir} holds {found}; a reward model must be {expected}")
    if config.num_labels != 1:
        raise RewardModelError(
            f"{model_dir} holds {archs[0]} with num_labels={config.num_labels} "
            f"(labels {list(config.id2label.values())}); a reward model must be {expected}"
        )
    if config.pad_token_id is None:
        raise RewardModelError(
            f"{model_dir}/config.json has no pad_token_id; set it to the tokenizer's pad id "
            "so batched scoring can find each text's last token"
        )
    with loading_on_this_thread():
        model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), use_safetensors=True, dtype=dtype, local_files_only=True
        )
    return model.eval()


@torch.no_grad()
def score_texts(
    rm: PreTrainedModel, tokenizer, texts: Sequence[str], batch_size: int = 32
) -> list[float]:
    """One scalar score per text, scored `batch_size` at a time.

    Texts are tokenized with the tokenizer's special tokens and right-padded with the
    model's `pad_token_id`, so a text's score does not depend on its batch mates.
    """
    pad_id = rm.config.pad_token_id
    device = next(rm.parameters()).device
    scores: list[float] = []
    for first in range(0, len(texts), batch_size):
        encoded = tokenizer(list(texts[first : first + batch_size]))["input_ids"]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)  # (b, L)
        attention_mask = torch.zeros_like(input_ids)  # (b, L)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        logits = rm(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        scores.extend(logits[:, 0].float().cpu().tolist())  # (b, 1) -> b floats
    return scores
