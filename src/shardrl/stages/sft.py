"""Supervised warm start: train on (prompt, answer) demonstrations until validation loss plateaus."""

from __future__ import annotations

import copy
import logging
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..algo import lr_schedule
from ..config.model import SFTConfig
from ..tasks.prompts import PromptFormat

log = logging.getLogger("shardrl.snapshot")


@dataclass
class SFTResult:
    epochs: int
    steps: int
    best_epoch: int
    best_val_loss: float
    train_loss: float


def encode_pairs(tokenizer, pairs: list[tuple[str, str]],
                 prompt_format: PromptFormat | None = None) -> list[tuple[list[int], int]]:
    """(token ids of formatted prompt + answer + eos, index where the answer starts) per
    pair; the prompt is formatted as rollout formats it (`PromptFormat`, raw by default)."""
    fmt = prompt_format or PromptFormat()
    return [fmt.encode_pair(tokenizer, prompt, answer) for prompt, answer in pairs]


Row = tuple[list[int], "int | list[int]"]
"""Token ids and what to learn of them: the index where the answer starts, or (an episode) a
0/1 mask over the ids, 1 on the policy's tokens."""


def _batch(rows: list[Row], pad: int):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, start) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        if isinstance(start, int):
            labels[i, start: len(seq)] = torch.tensor(seq[start:])
        else:
            labels[i, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, start,
                                                                                   strict=True)])
    return ids, attn, labels


def answer_loss(model, rows, pad: int) -> torch.Tensor:
    """Mean cross-entropy over answer tokens (and eos) of `rows`."""
    ids, attn, labels = _batch(rows, pad)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (B, L-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


@torch.no_grad()
def validation_loss(model, rows, pad: int, batch_size: int = 256) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        total += float(answer_loss(model, chunk, pad)) * len(chunk)
        count += len(chunk)
    model.train()
    return total / max(count, 1)


def encode_episodes(tokenizer, demos, prompt_format: PromptFormat | None = None) -> list[Row]:
    """(token ids, policy mask) of demonstrated episodes (`tasks.episodic.Demo`), laid out as
    rollout lays out an episode: each turn's text and EOS learned, the replies between turns
    (`PromptFormat.observation_text`) only read."""
    fmt = prompt_format or PromptFormat()
    rows = []
    for demo in demos:
        ids = fmt.encode(tokenizer, [demo.prompt])[0]
        mask = [0] * len(ids)
        for action, observation in demo.turns:
            act = list(tokenizer(action, add_special_tokens=False)["input_ids"])
            act.append(tokenizer.eos_token_id)
            obs = fmt.encode_observation(tokenizer, observation) if observation else []
            ids, mask = ids + act + obs, mask + [1] * len(act) + [0] * len(obs)
        rows.append((ids, mask))
    return rows


def train_sft(model, tokenizer, train_pairs, val_pairs, cfg: SFTConfig, seed: int,
              prompt_format: PromptFormat | None = None, encode=encode_pairs) -> SFTResult:
    """Train in place to the plateau of the validation loss; keeps the best epoch's weights.
    `encode(tokenizer, examples, prompt_format)` makes the rows: `encode_pairs` for
    (prompt, answer) pairs, `encode_episodes` for demonstrated episodes."""
    train_rows = encode(tokenizer, train_pairs, prompt_format)
    val_rows = encode(tokenizer, val_pairs, prompt_format)
    pad = tokenizer.pad_token_id
    steps_per_epoch = math.ceil(len(train_rows) / cfg.batch_size)
    total = steps_per_epoch * cfg.max_epochs
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(seed)
    best, best_state, best_epoch, since_best = math.inf, None, 0, 0
    step, epoch, train_loss = 0, 0, math.nan
    model.train()
    for epoch in range(1, cfg.max_epochs + 1):
        rng.shuffle(train_rows)
        for i in range(0, len(train_rows), cfg.batch_size):
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_schedule(step, warmup_steps=cfg.warmup_steps,
                                                   total_steps=total, kind="constant")
            loss = answer_loss(model, train_rows[i: i + cfg.batch_size], pad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            train_loss = float(loss.detach())
        val = validation_loss(model, val_rows, pad)
        log.info("sft epoch %d step %d train_loss %.4f val_loss %.4f", epoch, step, train_loss, val)
        if val < best - 1e-4:
            best, best_epoch, since_best = val, epoch, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            since_best += 1
            if since_best >= cfg.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return SFTResult(epochs=epoch, steps=step, best_epoch=best_epoch, best_val_loss=best,
                     train_loss=train_loss)
