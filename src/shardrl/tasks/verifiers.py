"""Verifiers: `(response, answer) -> float` checkers, registered by name or given by path.

Registered names: `exact_match`, `numeric`, `math_final_answer`, `python_exec` (always
sandboxed). Any other spec is a dotted path `package.module:function`. `run_verifier`
is the only way callers run one: a verifier that raises or returns a non-finite or
non-numeric value yields reward 0.0 and an error string, never an exception.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction

from shardrl.tasks.sandbox import (
    SandboxError,
    SandboxLimits,
    python_exec_verifier,
    sandboxed_verifier,
)

Verifier = Callable[[str, str], float]

VERIFIERS: dict[str, Verifier] = {}
SANDBOXED_ONLY = {"python_exec"}
MAX_ERROR_CHARS = 500

# A number as written in text: 1,234.5 / -3 / 3/4 / 2.5e-3 / .5
_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?")
_BOXED = "\\boxed{"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*([^\n]+)")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


class VerifierError(ValueError):
    """A verifier spec names nothing usable."""


def register_verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Decorator adding a verifier to the registry under `name`."""

    def add(fn: Verifier) -> Verifier:
        if name in VERIFIERS:
            raise VerifierError(f"verifier {name!r} is registered twice")
        VERIFIERS[name] = fn
        return fn

    return add


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number written as `1,234`, `-0.5`, `3/4`, `\\frac{3}{4}`, `2e3`, `$5`."""
    s = _FRAC.sub(r"(\1)/(\2)", text.strip().rstrip(".").strip("$"))
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s).replace(" ", "").replace("(", "").replace(")", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | None:
    """The last number in `text`, or None."""
    for match in reversed(_NUMBER.findall(text)):
        if (value := parse_number(match)) is not None:
            return value
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _leading_answer(text: str) -> str:
    """A number at the start of `text` ("42 apples" -> "42"), else `text` up to ". " or ", "."""
    if number := _NUMBER.match(text.strip().lstrip("$")):
        return number.group(0)
    return re.split(r"\.\s|,\s", text, maxsplit=1)[0]


def final_answer(response: str) -> str | None:
    """The final answer a response states: `\\boxed{}`, then "answer is X", "#### X",
    then the last number."""
    if (boxed := last_boxed(response)) is not None:
        return boxed
    for pattern in (_ANSWER_IS, _HASHES):
        if found := pattern.findall(response):
            return _leading_answer(found[-1])
    found = _NUMBER.findall(response)
    return found[-1] if found else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().rstrip(".").strip("$")).lower()


@register_verifier("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1.0 when response and answer are equal after stripping surrounding whitespace."""
    return 1.0 if response.strip() == answer.strip() else 0.0


@register_verifier("numeric")
def numeric(response: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last number of the response is within tolerance of the answer.

    Raises ValueError when the answer itself is not a number (a data error, not the model's).
    """
    expected = parse_number(answer)
    if expected is None:
        raise ValueError(f"answer {answer!r} is not a number")
    got = last_number(response)
    if got is None:
        return 0.0
    return (
        1.0 if math.isclose(float(got), float(expected), rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
    )


@register_verifier("math_final_answer")
def math_final_answer(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference.

    Numbers compare exactly as fractions (`0.5` == `1/2` == `\\frac{1}{2}`, `1,000` ==
    `1000`); anything else compares as text without spaces, `$` or a final period.
    """
    stated = final_answer(response)
    if stated is None:
        return 0.0
    got, expected = parse_number(stated), parse_number(answer)
    if got is not None and expected is not None:
        return 1.0 if got == expected else 0.0
    return 1.0 if _normalise(stated) == _normalise(answer) else 0.0


VERIFIERS["python_exec"] = python_exec_verifier(SandboxLimits())


def resolve_dotted(path: str) -> Verifier:
    """Import `package.module:function` (the function may be `Class.attr`)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise VerifierError(
            f"verifier {path!r} is neither a registered name ({', '.join(sorted(VERIFIERS))}) "
            "nor a dotted path `package.module:function`"
        )
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise VerifierError(f"cannot load verifier {path!r}: {exc}") from exc
    if not callable(target):
        raise VerifierError(f"verifier {path!r} is not callable")
    return target


def dotted_path_of(fn: Verifier) -> str:
    """`module:qualname` of a module-level function, for running it in the sandbox."""
    return f"{fn.__module__}:{fn.__qualname__}"


def get_verifier(
    spec: str, *, sandboxed: bool = False, limits: SandboxLimits | None = None
) -> Verifier:
    """The verifier named by `spec`; with `sandboxed`, it runs in a limited subprocess.

    `python_exec` always runs its snippet sandboxed, with `limits` when given.
    """
    limits = limits or SandboxLimits()
    if spec in SANDBOXED_ONLY:
        return python_exec_verifier(limits)
    fn = VERIFIERS.get(spec) or resolve_dotted(spec)
    if not sandboxed:
        return fn
    return sandboxed_verifier(spec if ":" in spec else dotted_path_of(fn), limits)


def run_verifier(fn: Verifier, response: str, answer: str) -> tuple[float, str | None]:
    """(reward, error): reward 0.0 with the reason when the verifier fails; never raises."""
    try:
        value = fn(response, answer)
    except SandboxError as exc:
        return 0.0, str(exc)
    except Exception as exc:  # untrusted code: any failure is a zero reward, reported
        return 0.0, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    if not isinstance(value, numbers.Real):
        return 0.0, f"verifier returned {type(value).__name__}, expected a float"
    if not math.isfinite(value):
        return 0.0, f"verifier returned non-finite {value}"
    return float(value), None
