"""The built-in cipher task: shift every letter of a word one place along a 10-letter alphabet.

A prompt is the word followed by `=`, the answer the shifted word, e.g. `"cafj="` -> `"dbga"`
(`j` wraps to `a`). Words have 3 to 6 letters, so there are about 1.1 million prompts. The
category of an item is its length (`"len_3"` ... `"len_6"`): longer words leave more room
for a slip. Splits are disjoint by construction, as for the addition task: a prompt's split
is a function of a hash of its text (`split_of`).

Tiny models learn this mapping from a few hundred demonstrations in a minute on a CPU, which
leaves the demo's time for what it is about: what RL with a verifier adds beyond imitation.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .builtin import SplitTask, TaskItem

ALPHABET = "abcdefghij"


def shift(word: str) -> str:
    """Each letter moved one place along ALPHABET, wrapping at the end."""
    return "".join(ALPHABET[(ALPHABET.index(c) + 1) % len(ALPHABET)] for c in word)


@dataclass(frozen=True)
class CipherTask(SplitTask):
    """Letter-shift cipher over words of `min_len`..`max_len` letters."""

    name: str = "cipher"
    min_len: int = 3
    max_len: int = 6

    def make_item(self, word: str) -> TaskItem:
        prompt = f"{word}="
        prompt_id = hashlib.blake2b(prompt.encode(), digest_size=6).hexdigest()
        return TaskItem(prompt_id=prompt_id, prompt=prompt, answer=shift(word),
                        category=f"len_{len(word)}")

    def _draw(self, rng: random.Random) -> TaskItem:
        n = rng.randint(self.min_len, self.max_len)
        return self.make_item("".join(rng.choice(ALPHABET) for _ in range(n)))


def with_slips(pairs: list[tuple[str, str]], rate: float, seed: int) -> list[tuple[str, str]]:
    """Demonstrations as an imperfect demonstrator writes them: a share `rate` of the answers
    has one character replaced by its neighbour (a slip). Deterministic given `seed`."""
    rng = random.Random(seed)
    out = []
    for prompt, answer in pairs:
        if answer and rng.random() < rate:
            chars = list(answer)
            i = rng.randrange(len(chars))
            chars[i] = _neighbour(chars[i], rng)
            answer = "".join(chars)
        out.append((prompt, answer))
    return out


def _neighbour(c: str, rng: random.Random) -> str:
    for alphabet in (ALPHABET, "0123456789"):
        if c in alphabet:
            return alphabet[(alphabet.index(c) + rng.choice((1, -1))) % len(alphabet)]
    return c
