"""Built-in tasks played over several turns in an environment, with demonstrations in code.

`calculator`: a short word problem whose numbers are too large for a tiny model's mental
arithmetic, e.g. `"8 boxes of 47 eggs. total?"`, answer `"376"`. The demonstrator calls the
tool, `calc(8*47)`, reads the reply `= 376` and states `answer: 376`; with probability
`demo_error_rate` it skips the tool and states a guess instead, one digit off. A model
warm-started on these demonstrations calls the tool most of the time and guesses the rest:
RL with the environment's reward learns that the tool pays.

`guess`: find a secret number in a range of 8 to 16 numbers from `higher`/`lower` replies,
e.g. prompt `"guess 523-537"`. The demonstrator bisects (`guess: 30`, `= higher`, `guess: 34`, ...); with
probability `demo_error_rate` one of its guesses is off the middle by one, which costs a turn.

Both are `SplitTask`s: disjoint held-out, validation and training prompts by hash.
`demonstration(item, rng, slip)` is a demonstrator's whole episode as `Demo` turns, whose
observations are exactly the environment's (`tasks.environments`).
"""

from __future__ import annotations

import hashlib
import operator
import random
from dataclasses import dataclass

from .builtin import SplitTask, TaskItem


@dataclass(frozen=True)
class Demo:
    """A demonstrated episode: the prompt, then per turn (the policy's text, the
    environment's reply; "" after the last turn)."""

    prompt: str
    turns: tuple[tuple[str, str], ...]

    def text(self) -> str:
        """The episode as one text (for a tokenizer's corpus)."""
        return self.prompt + "".join(a + o for a, o in self.turns)


def _item(prompt: str, answer: str, category: str) -> TaskItem:
    pid = hashlib.blake2b(f"{prompt}|{answer}".encode(), digest_size=6).hexdigest()
    return TaskItem(prompt_id=pid, prompt=prompt, answer=answer, category=category)


def _slip(number: int, rng: random.Random) -> int:
    """`number` with one digit moved by one: a different number of as many digits."""
    digits = list(str(number))
    i = rng.randrange(len(digits))
    d, lowest = int(digits[i]), 1 if i == 0 and len(digits) > 1 else 0
    digits[i] = str(rng.choice([x for x in (d - 1, d + 1) if lowest <= x <= 9]))
    return int("".join(digits))


# -- calculator word problems ----------------------------------------------------------------

_PROBLEMS = {
    "add": ("{a} eggs, {b} more. total?", "{a}+{b}"),
    "sub": ("{a} eggs, {b} eaten. left?", "{a}-{b}"),
    "mul": ("{a} boxes of {b} eggs. total?", "{a}*{b}"),
    "div": ("{a} eggs in {b} boxes. each?", "{a}/{b}"),
}
_APPLY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
          "div": operator.floordiv}  # division items are drawn exact


@dataclass(frozen=True)
class CalcTask(SplitTask):
    """Word problems of the four operations on two-digit numbers (see the module docstring)."""

    name: str = "calculator"

    def make_item(self, op: str, a: int, b: int) -> TaskItem:
        text = _PROBLEMS[op][0]
        return _item(text.format(a=a, b=b), str(_APPLY[op](a, b)), op)

    def expression(self, item: TaskItem) -> str:
        """The tool call's argument that solves `item`."""
        a, b = (int(w) for w in item.prompt.split() if w.isdigit())
        return _PROBLEMS[item.category][1].format(a=a, b=b)

    def _draw(self, rng: random.Random) -> TaskItem:
        op = rng.choice(sorted(_PROBLEMS))
        if op == "add":
            return self.make_item(op, rng.randint(10, 99), rng.randint(10, 99))
        if op == "sub":
            a = rng.randint(20, 99)
            return self.make_item(op, a, rng.randint(10, a - 1))
        if op == "mul":
            return self.make_item(op, rng.randint(2, 9), rng.randint(10, 99))
        b = rng.randint(2, 9)
        return self.make_item(op, b * rng.randint(10, 99), b)

    def demonstration(self, item: TaskItem, rng: random.Random, slip: bool) -> Demo:
        if slip:  # no tool: a guess one digit off
            return Demo(item.prompt, ((f"answer: {_slip(int(item.answer), rng)}", ""),))
        return Demo(item.prompt, ((f"calc({self.expression(item)})", f"= {item.answer}"),
                                  (f"answer: {item.answer}", "")))


# -- guess the number ------------------------------------------------------------------------

GUESS_MAX_WIDTH = 15
"""Ranges hold 8 to 16 numbers: bisection finds the secret in at most 5 guesses."""


def guess_range(prompt: str) -> tuple[int, int]:
    """(low, high) of a `guess low-high` prompt."""
    low, _, high = prompt.split()[-1].partition("-")
    return int(low), int(high)


def feedback(guess: int, secret: int) -> str:
    """The environment's reply to a wrong guess."""
    return "= higher" if secret > guess else "= lower"


@dataclass(frozen=True)
class GuessTask(SplitTask):
    """Guess a secret in `guess low-high` from higher/lower replies."""

    name: str = "guess"

    def make_item(self, low: int, high: int, secret: int) -> TaskItem:
        return _item(f"guess {low}-{high}", str(secret), f"width_{high - low + 1}")

    def _draw(self, rng: random.Random) -> TaskItem:
        low = rng.randint(0, 980)  # about 8,800 ranges: 10% of them make 256 held-out items
        high = low + rng.randint(7, GUESS_MAX_WIDTH)
        return self.make_item(low, high, rng.randint(low, high))

    def demonstration(self, item: TaskItem, rng: random.Random, slip: bool) -> Demo:
        low, high = guess_range(item.prompt)
        secret, turns = int(item.answer), []
        slip_at = rng.randrange(3) if slip else -1
        while True:
            guess = (low + high) // 2
            if len(turns) == slip_at and low < high:
                guess = min(high, guess + 1)
            if guess == secret:
                turns.append((f"guess: {guess}", ""))
                return Demo(item.prompt, tuple(turns))
            turns.append((f"guess: {guess}", feedback(guess, secret)))
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)


def demonstrations(task: CalcTask | GuessTask, n: int, seed: int,
                   error_rate: float) -> list[Demo]:
    """`n` demonstrated episodes of distinct training items; a share `error_rate` with the
    demonstrator's slip. Deterministic given `seed`."""
    rng = random.Random(seed)
    return [task.demonstration(item, rng, rng.random() < error_rate)
            for item in task._distinct("train", n, seed + 7_919)]
