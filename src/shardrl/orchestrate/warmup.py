"""Paying the libraries' first-call costs once, before any stage (or a baseline) starts.

The first `from_pretrained`, the first generation and the first backward pass and AdamW step
of a process each cost far more than the later ones: transformers resolves and imports the
model's classes, torch initialises its kernels and the autograd engine, safetensors and the
generation utilities load lazily. On a small machine the stages would pay that side by side
right after the snapshot is published, before the first shard and the first step. The
runner, which forks every stage, calls `exercise` once beforehand on a throwaway model of a
few hundred parameters, so each forked stage starts with those paths warm (copied on write,
not paid again). The benchmarks' peers call it too before their clocks start, so every side
of a comparison starts equally warm.

It runs its torch operations on one thread: with a single thread torch starts no OpenMP
worker pool, and a process that forks must not have one (a forked child cannot use the
parent's pool). The thread count is restored afterwards.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import torch

from ..engines.hf import HFEngine
from ..learner_backends.base import PolicyModule
from ..models.io import load_causal_lm, save_model
from ..models.tiny import tiny_lm

VOCAB, PAD, EOS = 12, 0, 2


def exercise() -> None:
    """Save and load a throwaway model, sample from it, and take one AdamW step on it, all on
    one torch thread."""
    from transformers.utils import logging as hf_logging

    previous = torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # a throwaway model's bars in the run's output
    try:
        with tempfile.TemporaryDirectory(prefix="shardrl-warmup-") as folder:
            save_model(tiny_lm(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS,
                               pad_token_id=PAD, hidden_size=8, num_layers=1, num_heads=2,
                               intermediate_size=16, max_position_embeddings=16, seed=0),
                       None, folder)
            model = load_causal_lm(folder)
        engine = HFEngine(model, eos_token_id=EOS, pad_token_id=PAD)
        engine.generate([[1, 5, 6], [1, 7]], 2, temperature=1.0, top_p=0.9, max_new_tokens=3,
                        seed=0)
        model.train()
        policy = PolicyModule(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.tensor([[1, 5, 6, 7, 8], [0, 1, 7, 9, 3]])  # (B, L), left-padded
        out = policy(ids, (ids != PAD).long(), torch.tensor([3, 3]))
        (-out.logprobs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    finally:
        torch.set_num_threads(previous)
        if bars:
            hf_logging.enable_progress_bar()


def threads() -> set[str]:
    """This process's threads as `id:name` (the OS's list where it gives one: native ones
    too; else the Python threads)."""
    try:
        ids = os.listdir("/proc/self/task")
    except OSError:
        return {f"{t.ident}:{t.name}" for t in threading.enumerate()}
    names = set()
    for tid in ids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f"{tid}:{f.read().strip()}")
        except OSError:  # ended meanwhile
            pass
    return names


def new_threads(before: set[str], settle_s: float = 1.0) -> list[str]:
    """Threads started since `before` was taken that are still alive after up to `settle_s`
    seconds (threads a library is winding down may take a moment to exit)."""
    deadline = time.monotonic() + settle_s
    while (extra := sorted(threads() - before)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return extra
