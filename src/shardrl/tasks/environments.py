"""Environments for multi-turn episodes, and an episode's tokens with the policy's mask.

An environment turns a task item into an episode: `reset(item)` gives the first observation
(the text the policy answers), and `step(action)` takes one policy turn's text and gives
`(observation, reward, done)`: the tool's reply or the environment's feedback, this turn's
reward, and whether the episode is over. The rollout stops an episode after `max_turns`
policy turns whether or not it is done.

Environments are registered by name (`@register_environment("calculator")`) or given as
`package.module:Class`; `make_environment(spec)` builds one, one instance per episode.

An episode's tokens are the prompt, then for each turn the policy's tokens and the
observation's (templated by the caller: the chat template's turn markers are part of the
observation's tokens). `episode_tokens` lays them out as one response with a mask that is 1
on the tokens the policy generated and 0 on the environment's: only masked-in tokens carry
behaviour logprobs, loss and learner logprobs (`stages.batch.build_batch` multiplies the
response mask by it). A single turn with no observation gives exactly the single-turn
response: the mask is all ones.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from .builtin import TaskItem
from .verifiers import numeric


@dataclass(frozen=True)
class StepResult:
    observation: str
    """Text the environment returns (empty when the episode is over)."""
    reward: float
    done: bool


class Environment(Protocol):
    """One episode at a time: `reset` starts it, `step` answers each policy turn."""

    def reset(self, item: TaskItem) -> str: ...

    def step(self, action: str) -> StepResult: ...


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


class EnvironmentSpecError(ValueError):
    """An environment spec that names nothing usable."""


def register_environment(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if name in ENVIRONMENTS:
            raise EnvironmentSpecError(f"environment {name!r} is registered twice")
        ENVIRONMENTS[name] = cls
        return cls
    return add


def make_environment(spec: str, **settings) -> Environment:
    """A new environment: a registered name, or `package.module:Class`.

    `settings` are the run's settings an environment may take by name, e.g. `sandbox` (the
    `SandboxLimits` for running untrusted code); each goes only to a class whose constructor
    has a parameter of that name.
    """
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise EnvironmentSpecError(f"environment {spec!r}: {exc}") from None
    elif spec in ENVIRONMENTS:
        cls = ENVIRONMENTS[spec]
    else:
        raise EnvironmentSpecError(f"environment {spec!r} is neither a registered name "
                                f"({', '.join(sorted(ENVIRONMENTS))}) nor package.module:Class")
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C class: no signature to read
        accepted = {}
    env = cls(**{k: v for k, v in settings.items() if k in accepted})
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise EnvironmentSpecError(f"environment {spec!r} has no reset(item) and step(action)")
    return env


# -- the calculator ------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}
MAX_CALC_CHARS = 64
MAX_MAGNITUDE = 10**12
"""Larger intermediate results are refused: `calc` stays a cheap, bounded tool."""


def calculate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression of numbers, + - * / and parentheses.

    Parsed, never executed: anything else (names, calls, powers, attributes) is a ValueError,
    so the tool needs no sandbox; so are division by zero and results past `MAX_MAGNITUDE`.
    """
    if len(expr) > MAX_CALC_CHARS:
        raise ValueError(f"expression longer than {MAX_CALC_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = Fraction(str(node.value))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            out = value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            out = _OPS[type(node.op)](left, right)
        else:
            raise ValueError(f"not an arithmetic expression: {expr!r}")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return out

    return value(tree.body)


def _show(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"


_CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
_ANSWER = re.compile(r"\banswer\s*[:=]\s*(\S+)", re.IGNORECASE)


class ToolProblem:
    """A problem the policy answers after any number of tool calls.

    `answer: <number>` ends the episode with reward 1 when it equals the item's answer, else
    0 (a number too large for a float among them); a turn with a tool call (`call` returns
    the tool's reply) gets the reply back with reward 0; a turn that does neither ends the
    episode with reward 0. The first observation is the item's prompt. An `answer` inside a
    fenced code block is code (`answer = 8 * 47`), not the turn's answer.
    """

    def __init__(self) -> None:
        self.item: TaskItem | None = None

    def reset(self, item: TaskItem) -> str:
        self.item = item
        return item.prompt

    def step(self, action: str) -> StepResult:
        if self.item is None:
            raise RuntimeError("step before reset")
        if m := _ANSWER.search(_CODE.sub("", action)):
            try:
                reward = numeric(m[1], self.item.answer)
            except ArithmeticError:  # e.g. 1e400: no float holds it, so it is not the answer
                reward = 0.0
            return StepResult("", reward, True)
        reply = self.call(action)
        return StepResult("", 0.0, True) if reply is None else StepResult(reply, 0.0, False)

    def call(self, action: str) -> str | None:
        """The tool's reply to the turn's call, None when the turn calls no tool."""
        raise NotImplementedError


@register_environment("calculator")
class Calculator(ToolProblem):
    """A word problem with a calculator tool: `calc(<expression>)` gets `= <value>` back, or
    `error: <why>` (see `ToolProblem` for answers)."""

    def call(self, action: str) -> str | None:
        if not (m := _CALL.search(action)):
            return None
        try:
            return f"= {_show(calculate(m[1]))}"
        except ValueError as exc:
            return f"error: {exc}"


@register_environment("guess")
class Guess:
    """Guess the item's number (its answer) in the prompt's range `guess low-high`.

    Each turn states `guess: <n>`: the right number ends the episode with reward 1, another
    gets `= higher` or `= lower` with reward 0. A turn without a guess ends it with reward 0.
    """

    def __init__(self) -> None:
        self.secret: int | None = None

    def reset(self, item: TaskItem) -> str:
        self.secret = int(item.answer)
        return item.prompt

    def step(self, action: str) -> StepResult:
        if self.secret is None:
            raise RuntimeError("step before reset")
        if not (m := _GUESS.search(action)):
            return StepResult("", 0.0, True)
        try:
            guess = int(m[1])
        except ValueError:  # more digits than Python converts: not the secret either
            return StepResult("", 0.0, True)
        if guess == self.secret:
            return StepResult("", 1.0, True)
        return StepResult("= higher" if self.secret > guess else "= lower", 0.0, False)


_GUESS = re.compile(r"guess\s*[:=]?\s*(-?\d+)", re.IGNORECASE)

MAX_TOOL_OUTPUT = 200
"""Characters of a tool's output the policy sees (the rest is cut, with a marker)."""


@register_environment("python")
class PythonTool(ToolProblem):
    """A problem with a Python interpreter as the tool (see `ToolProblem` for answers).

    A turn with a fenced code block (```python ... ```) runs that code in the sandbox (a
    separate process under CPU-time, memory and wall-clock limits, with a scratch directory
    and no inherited environment) and gets its output back: stdout, or `error: <why>`
    (timeout, memory, the exception), at most `MAX_TOOL_OUTPUT` characters.
    """

    def __init__(self, sandbox=None) -> None:
        from .sandbox import SandboxLimits

        super().__init__()
        self.limits = sandbox if sandbox is not None else SandboxLimits()

    def call(self, action: str) -> str | None:
        from .sandbox import run_python_snippet

        if not (m := _CODE.search(action)):
            return None
        result = run_python_snippet(m[1], self.limits)
        text = (result.stdout or "").strip() if result.error is None else f"error: {result.error}"
        if len(text) > MAX_TOOL_OUTPUT:
            text = text[:MAX_TOOL_OUTPUT] + " [cut]"
        return text or "(no output)"


_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


# -- an episode's tokens --------------------------------------------------------------------

@dataclass
class Turn:
    """One policy turn: its tokens and their behaviour logprobs, then the environment's reply
    (tokenized with whatever template the caller puts between turns) and the turn's reward."""

    action_ids: list[int]
    action_logprobs: list[float]
    observation_ids: list[int] = field(default_factory=list)
    reward: float = 0.0

    def __post_init__(self) -> None:
        if len(self.action_ids) != len(self.action_logprobs):
            raise ValueError(f"{len(self.action_ids)} action tokens, "
                             f"{len(self.action_logprobs)} logprobs")


@dataclass(frozen=True)
class EpisodeTokens:
    """An episode as one response after the prompt (what a shard row records)."""

    response_token_ids: list[int]
    policy_mask: list[int]
    """1 on the policy's tokens, 0 on the environment's; one per response token."""
    behavior_logprobs: list[float]
    """The behaviour logprob of each policy token, 0.0 on the environment's tokens."""
    turn_rewards: list[float]
    turn_starts: list[int]
    """Response position where each turn's policy tokens begin."""

    @property
    def episode_return(self) -> float:
        """The episode's reward: the sum of its turns' (the group advantage's input)."""
        return float(sum(self.turn_rewards))


def episode_tokens(turns: Sequence[Turn]) -> EpisodeTokens:
    """Lay out `turns` as one response with its policy mask (see the module docstring).

    The last turn's observation is kept when there is one (an episode cut at `max_turns`
    ends on the environment's reply); it is masked out like every observation.
    """
    if not turns:
        raise ValueError("an episode has at least one policy turn")
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    starts: list[int] = []
    for turn in turns:
        starts.append(len(ids))
        ids += turn.action_ids
        mask += [1] * len(turn.action_ids)
        logprobs += turn.action_logprobs
        ids += turn.observation_ids
        mask += [0] * len(turn.observation_ids)
        logprobs += [0.0] * len(turn.observation_ids)
    return EpisodeTokens(ids, mask, logprobs, [t.reward for t in turns], starts)
