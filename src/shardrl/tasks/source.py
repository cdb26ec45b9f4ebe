"""The task a run trains on, as the stages see it: prompts, demonstrations, held-out items."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import RunConfig
from ..config.data import BuiltinTask as BuiltinTaskConfig
from .builtin import BuiltinTask, TaskItem
from .cipher import CipherTask, with_slips
from .episodic import CalcTask, Demo, GuessTask
from .episodic import demonstrations as demo_episodes

# validation items kept apart from the demonstrations to detect the SFT plateau
VALIDATION_ITEMS = 256


def _mix(*parts: int) -> int:
    blob = ",".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big") >> 1


@dataclass
class TaskData:
    """Uniform access to a built-in task or a user dataset."""

    train_items: Callable[[int, int, int], list[TaskItem]]
    """(worker, seq, n) -> n training prompts, deterministic per (worker, seq)."""
    demonstrations: Callable[[int], list[tuple[str, str]]]
    """n -> (prompt, answer) pairs for SFT."""
    validation: list[TaskItem]
    """Items for SFT plateau detection (never the held-out ones)."""
    heldout: list[TaskItem]
    """The fixed evaluation split."""
    verify: Callable[[str, str], float]
    """The task's own checker (response, answer) -> reward: exact for raw prompts, the
    stated final answer (`verifiers.math_final_answer`) for chat prompts."""
    corpus: list[str] = field(default_factory=list)
    """Texts covering the task's characters (to train a tokenizer)."""
    episodes: Callable[[int], list[Demo]] | None = None
    """n -> demonstrated episodes for SFT (tasks played in an environment; None otherwise).
    `demonstrations` then gives each as (prompt, the rest of its text)."""
    demonstrate: Callable[[TaskItem], Demo] | None = None
    """The demonstrator's episode of one item without slips (SFT validation)."""


_BUILT: dict[str, TaskData] = {}
"""Tasks built in this process, by `_task_key`."""


def make_task(cfg: RunConfig) -> TaskData:
    """The run's task, built once per process (a rollout worker's scorer uses the worker's),
    and inherited by stages forked from a runner that built it (`orchestrate.fork.warm`):
    building the held-out and validation splits takes a tenth of a second on a small core."""
    key = _task_key(cfg)
    if key not in _BUILT:
        _BUILT[key] = _make_task(cfg)
    return _BUILT[key]


def _task_key(cfg: RunConfig) -> str:
    """What a task depends on: the task section and the run's seed."""
    return json.dumps({"seed": cfg.seed, "task": cfg.task.model_dump(mode="json")},
                      sort_keys=True)


def _make_task(cfg: RunConfig) -> TaskData:
    source = cfg.task.source
    task = _builtin(cfg, source) if isinstance(source, BuiltinTaskConfig) else _dataset(cfg)
    if cfg.task.prompt_format == "chat":
        # a chat model answers in sentences ("17 + 25 = 42.", "The answer is **42**."):
        # the task's checker compares the final answer it states, not the whole response
        from .verifiers import math_final_answer

        task.verify = math_final_answer
    return task


def _builtin(cfg: RunConfig, source: BuiltinTaskConfig) -> TaskData:
    if source.name in ("calculator", "guess"):
        return _episodic(cfg, source)
    task = CipherTask() if source.name == "cipher" else BuiltinTask(max_digits=source.max_digits)

    def train_items(worker: int, seq: int, n: int) -> list[TaskItem]:
        stream = task.train_prompts(_mix(cfg.seed, source.seed, worker, seq))
        return list(itertools.islice(stream, n))

    def demonstrations(n: int) -> list[tuple[str, str]]:
        pairs = task.demonstrations(n, cfg.seed + source.seed)
        return with_slips(pairs, source.demo_error_rate, cfg.seed + source.seed)

    validation = task.validation(VALIDATION_ITEMS)
    heldout = task.heldout(source.heldout_size)
    corpus = ["0123456789+=-*/ ()abcdefghij"] + [it.prompt + it.answer for it in heldout[:64]]
    return TaskData(train_items, demonstrations, validation, heldout, task.verify, corpus)


def _episodic(cfg: RunConfig, source: BuiltinTaskConfig) -> TaskData:
    import random

    task = CalcTask() if source.name == "calculator" else GuessTask()
    seed = cfg.seed + source.seed

    def train_items(worker: int, seq: int, n: int) -> list[TaskItem]:
        return list(itertools.islice(task.train_prompts(_mix(cfg.seed, source.seed, worker, seq)), n))

    def episodes(n: int) -> list[Demo]:
        return demo_episodes(task, n, seed, source.demo_error_rate)

    def demonstrations(n: int) -> list[tuple[str, str]]:
        return [(d.prompt, d.text()[len(d.prompt):]) for d in episodes(n)]

    def demonstrate(item: TaskItem) -> Demo:
        return task.demonstration(item, random.Random(0), slip=False)

    validation = task.validation(VALIDATION_ITEMS)
    heldout = task.heldout(source.heldout_size)
    corpus = ["0123456789+-*/=():. ,?abcdefghijklmnopqrstuvwxyz"] + [
        demonstrate(it).text() for it in heldout[:64]]
    return TaskData(train_items, demonstrations, validation, heldout, task.verify, corpus,
                    episodes, demonstrate)


def _dataset(cfg: RunConfig) -> TaskData:
    from .datasets import DatasetError, load_items

    source = cfg.task.source
    train = [_templated(it, source.prompt_template) for it in load_items(source.train_path)]
    heldout = [_templated(it, source.prompt_template) for it in load_items(source.eval_path)]
    if not train or not heldout:
        raise ValueError("task dataset: both train_path and eval_path need at least one row")
    def same(prompt: str) -> str:  # what a chat template that trims would make of it
        return " ".join(prompt.split())

    held = {same(it.prompt) for it in heldout}
    if leaked := [it for it in train if same(it.prompt) in held]:
        # trained on, they would make the held-out pass rate read high: the held-out set
        # keeps them, as a built-in task's splits are disjoint by construction
        shown = ", ".join(repr(it.prompt[:60]) for it in leaked[:3])
        logging.getLogger("shardrl.task").warning(
            "%d training row(s) of %s hold a prompt of the held-out set %s (e.g. %s): left "
            "out of training", len(leaked), source.train_path, source.eval_path, shown)
        train = [it for it in train if same(it.prompt) not in held]
    n_val = min(VALIDATION_ITEMS, max(1, len(train) // 10))
    if len(train) <= n_val:
        raise DatasetError(f"{source.train_path}: {len(train)} training row(s) (held-out "
                           "prompts left out); at least 2 are needed, one held back to "
                           "validate the SFT on")
    validation, pool = train[:n_val], train[n_val:]

    def train_items(worker: int, seq: int, n: int) -> list[TaskItem]:
        start = _mix(cfg.seed, worker, seq) % len(pool)
        return [pool[(start + i) % len(pool)] for i in range(n)]

    def demonstrations(n: int) -> list[tuple[str, str]]:
        return [(it.prompt, it.answer) for it in pool[:n]]

    from .verifiers import exact_match

    # the tiny tokenizer learns from these: every character of every file, so that none of
    # the held-out set is unknown to it (characters alone, no held-out pair to learn)
    chars = set("".join(it.prompt + it.answer for it in (*train, *heldout)))
    corpus = [it.prompt + it.answer for it in train[:10_000]] + ["".join(sorted(chars))]
    return TaskData(train_items, demonstrations, validation, heldout, exact_match, corpus)


def _templated(item: TaskItem, template: str) -> TaskItem:
    if template == "{prompt}":
        return item
    return TaskItem(item.prompt_id, template.format(prompt=item.prompt), item.answer, item.category)
