"""The built-in verifiable task: multi-digit addition, generated in code.

A prompt is `"{a}+{b}="` and the answer is the decimal sum, e.g. `"347+85="` -> `"432"`.
Operands have 1 to `max_digits` digits (the digit count of each drawn uniformly, then the
number uniformly among those with that many digits). The category of an item is the number
of carries the column-wise sum needs (`"carries_0"`, `"carries_1"`, ...), the main source of
difficulty for a small model.

Splits are disjoint by construction: a prompt's split is a function of a hash of its text,
so the same prompt can never be both a training prompt and a held-out one, whatever seeds
are used. The held-out and validation splits are fixed lists (same every call, `heldout(n)`
is a prefix of `heldout(m)` for n < m); training prompts and demonstrations depend on a seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

HELDOUT_BUCKETS = range(0, 10)  # 10% of the prompt space
VALIDATION_BUCKETS = range(10, 20)  # 10%, for model selection (e.g. detecting a plateau)
HELDOUT_SEED = 1_000_003
VALIDATION_SEED = 2_000_003


@dataclass(frozen=True)
class TaskItem:
    """One prompt with its reference answer."""

    prompt_id: str
    prompt: str
    answer: str
    category: str


def split_of(prompt: str) -> str:
    """The split a prompt belongs to: "heldout", "validation" or "train" (by hash bucket)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big") % 100
    if bucket in HELDOUT_BUCKETS:
        return "heldout"
    if bucket in VALIDATION_BUCKETS:
        return "validation"
    return "train"


def count_carries(a: int, b: int) -> int:
    """Number of columns whose sum produces a carry, e.g. 95 + 7: 5+7=12 carries, 9+0+1=10
    carries again -> 2."""
    carries, carry = 0, 0
    while a or b:
        carry = 1 if a % 10 + b % 10 + carry >= 10 else 0
        carries += carry
        a, b = a // 10, b // 10
    return carries


def verify(response: str, answer: str) -> float:
    """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer else 0.0


UNSEEN_DRAWS = 50_000
"""Draws in a row without a new prompt after which a split counts as exhausted (or 20 per
prompt asked, if more): collecting every prompt of a built-in split, the longest run of
draws without a new one measured 5,726 (the guessing task's 7,108 training prompts)."""
_ASKED_BY = {"heldout": "task.source.heldout_size", "validation": "the SFT's validation set",
             "train": "model.sft.demonstrations"}


class SplitTask:
    """Splits, streams and the checker shared by the built-in tasks; a task supplies
    `_draw(rng) -> TaskItem`, one random item of the whole prompt space."""

    def _draw(self, rng: random.Random) -> TaskItem:
        raise NotImplementedError

    def _stream(self, split: str, seed: int) -> Iterator[TaskItem]:
        """Endless items of one split, drawn with `random.Random(seed)` (repeats possible)."""
        rng = random.Random(seed)
        while True:
            item = self._draw(rng)
            if split_of(item.prompt) == split:
                yield item

    def _distinct(self, split: str, n: int, seed: int) -> list[TaskItem]:
        """`n` distinct items of `split`; ValueError when the split seems to hold fewer (no
        new prompt in `max(UNSEEN_DRAWS, 20 * n)` draws in a row), not a search for ever."""
        seen: set[str] = set()
        items: list[TaskItem] = []
        since_new, give_up = 0, max(UNSEEN_DRAWS, 20 * n)
        for item in self._stream(split, seed):
            if len(items) == n:
                break
            if item.prompt not in seen:
                seen.add(item.prompt)
                items.append(item)
                since_new = 0
            elif (since_new := since_new + 1) >= give_up:
                raise ValueError(
                    f"task {getattr(self, 'name', type(self).__name__)!r}: its {split} split "
                    f"holds about {len(items)} distinct prompts, fewer than the {n} asked "
                    f"({_ASKED_BY[split]}): ask for fewer")
        return items

    def train_prompts(self, seed: int) -> Iterator[TaskItem]:
        """An endless stream of fresh training prompts (never held-out or validation ones)."""
        return self._stream("train", seed)

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` distinct (prompt, answer) pairs from the training split, for SFT."""
        return [(it.prompt, it.answer) for it in self._distinct("train", n, seed + 7_919)]

    def heldout(self, n: int) -> list[TaskItem]:
        """The first `n` items of the fixed held-out split (distinct prompts)."""
        return self._distinct("heldout", n, HELDOUT_SEED)

    def validation(self, n: int) -> list[TaskItem]:
        """The first `n` items of the fixed validation split (distinct prompts)."""
        return self._distinct("validation", n, VALIDATION_SEED)

    def verify(self, response: str, answer: str) -> float:
        """See `verify`."""
        return verify(response, answer)


@dataclass(frozen=True)
class BuiltinTask(SplitTask):
    """Addition of numbers with up to `max_digits` digits; see the module docstring."""

    name: str = "addition"
    max_digits: int = 3

    def make_item(self, a: int, b: int) -> TaskItem:
        """The item for `a + b`; its id is a short hash of the prompt text."""
        prompt = f"{a}+{b}="
        prompt_id = hashlib.blake2b(prompt.encode(), digest_size=6).hexdigest()
        return TaskItem(prompt_id=prompt_id, prompt=prompt, answer=str(a + b),
                        category=f"carries_{count_carries(a, b)}")

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _draw(self, rng: random.Random) -> TaskItem:
        return self.make_item(self._operand(rng), self._operand(rng))
