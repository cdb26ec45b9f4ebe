"""Stages driven in rounds in this process: each round is one stage's `main` with `--once`,
in the order a test chooses. Which shard meets which learner version is then fixed by the
test rather than left to the timing of concurrent processes, while every round runs the
stage's own code on the store (the synchronous pipeline runs stages the same way)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import torch

from shardrl.config import RunConfig, load_config
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.store import Store

from .conftest import TINY

ROUND_TIMEOUT_S = 120
"""A round that has not returned by then is stuck (a learner round waits for a batch)."""


def tiny_config(folder: Path, base: str = TINY, overrides: tuple[str, ...] = ()) -> RunConfig:
    """The tiny e2e settings without SFT or tracking, with `overrides` (key=value)."""
    path = folder / "rounds.yaml"
    path.write_text(base + "tracking: {enabled: false}\n")
    return load_config(str(path), ["model.sft.enabled=false", *overrides])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread (as the stage processes of a run), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _deadline(seconds: int, what: str) -> Iterator[None]:
    def expire(signum, frame):  # noqa: ARG001 - a signal handler's signature
        raise TimeoutError(f"{what} did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_round(store: Store, cfg: RunConfig, run_id: str, stage: str) -> None:
    """One `--once` round of `stage` for run `run_id` (worker 0 of 1); fails unless it exits 0."""
    ctx = StageContext(stage=stage, cfg=cfg, run_id=run_id, store=store, once=True,
                       log=logging.getLogger(f"rounds.{stage}"))
    ctx.metrics = MetricsSink(store, ctx.keys, stage, 0)
    try:
        with _deadline(ROUND_TIMEOUT_S, f"a round of {stage}"):
            code = importlib.import_module(f"shardrl.stages.{stage}").main(ctx)
        ctx.metrics.flush()
    finally:
        ctx.close()  # as a stage process ends: its model-file cache goes too
    assert code == 0, f"{stage} exited with {code}"
