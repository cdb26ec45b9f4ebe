"""Verifiers: `(response, answer) -> float` checkers, registered by name or given by path.

Registered names: `exact_match`, `numeric`, `math_final_answer`, `python_exec` (always
sandboxed). Any other spec is a dotted path `package.module:function`. `run_verifier`
is the only way callers run one: a verifier that raises or returns a non-finite or
non-numeric value yields reward 0.0 and an error string, never an exception.
"""

from __future__ import annotations

import importlib
import importlib.machinery
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
_EXPONENT = re.compile(r"[eE][-+]?(\d+)")
MAX_EXPONENT = 1000
"""Largest power of ten a number may be written with (`1e1000`) to count as one."""
_BOXED = "\\boxed{"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*([^\n]+)")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
# Markdown emphasis and code marks, and LaTeX inline-math delimiters, that chat models wrap
# their answers in: removed before an answer is looked for ("**42**", "`42`", "\\(42\\)").
_MARKUP = re.compile(r"\*\*|__|`|\\[()\[\]]")
_ITALIC = re.compile(r"(?<![\w*])[*_](?=\S)([^*_\n]+?)(?<=\S)[*_](?![\w*])")
_BOLD = re.compile(r"\*\*([^*\n]+)\*\*|__([^_\n]+)__")
# LaTeX that only dresses a value, removed before an answer is read: `\text{}` units,
# thin spaces (`1\,000`), `\left(`, escaped `\%` and `\$`, degrees, a Unicode minus sign
_DRESS = (
    (re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}"), r" \1"),
    (re.compile(r"\\(?:left|right)(?![a-zA-Z])|\\[,!;]|\^\{?\\circ\}?|\u00b0"), ""),
    (re.compile(r"\\([%$])"), r"\1"),
    (re.compile("\u2212"), "-"),
)
# The end of a stated answer's sentence ("42. Then", "42!"), not the point of "4.2"
_SENTENCE_END = re.compile(r"[.!?;](?:\s|$)")
# What makes a number the start of an expression or of a longer number, not an answer:
# "12 + 5", "2^3", "2\\sqrt{2}", "2π", "12:30", "1 000", "12,5", "12, 13", "2x", "2(3)"
_CONTINUES = re.compile(r"[a-zA-Z(](?![a-zA-Z])|\s*(?:[-+*/^:×÷·<>²³\dπ√\\]|,\s*-?\d|x\s*\d)")
# An answer offered as one of alternatives: "12 or 13", "12, or maybe 13", "12 (or 13)",
# "\\boxed{12} or \\boxed{13}"
_OR = r"\bor\s+(?:maybe\s+|perhaps\s+|possibly\s+)?[$*_(]*(?:\\boxed\{)?"
_OR_BEFORE = re.compile(rf"\d[\s$*_)}},]*{_OR}$")
_OR_AFTER = re.compile(rf"[\s$*_)}},(]*{_OR}-?\d")
# A retraction after an answer: "Wait, ...", "Actually, ...", "I made a mistake", "is wrong"
_RETRACT = re.compile(
    r"\b(?:wait|oops|correction|actually)[,:!]"
    r"|\bmade an? (?:\w+ )?(?:mistake|error)\b|\b(?:is|was|'s) (?:wrong|incorrect)\b",
    re.IGNORECASE,
)
_WORD_EDGE = " \t.,;:!?\"'()[]{}"


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
    """Exact value of a number written as `1,234`, `1{,}234`, `-0.5`, `3/4`, `\\frac{3}{4}`,
    `2e3`, `$5`, `1 000`; None for anything else (a mixed number `3\\frac{1}{2}`, digits
    apart `4 2`), and for exponents beyond +-`MAX_EXPONENT` (the exact value of
    `1e999999999` would take hours to compute)."""
    if re.search(r"\d\s*\\[dt]?frac|\d\s+(?!\d{3}\b)\d", text):
        return None
    s = _FRAC.sub(r"(\1)/(\2)", text.strip().rstrip(".").strip("$").replace("{,}", ","))
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s).replace(" ", "").replace("(", "").replace(")", "")
    if any(len(e.lstrip("0")) > 4 or int(e) > MAX_EXPONENT for e in _EXPONENT.findall(s)):
        return None
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


def _leading_answer(text: str, whole: bool = False) -> tuple[str, str]:
    """(answer, the text after it) of a stated answer: the number it starts with ("42
    apples" -> "42"), else the number after its last "=" ("5+38 = 43." -> "43"), unless
    that number goes on into an expression ("12 + 5", "2^3", "12, 13"): then the whole
    expression. Without a number: `text` up to ", " ("x + 1, clearly"), or all of it with
    `whole`."""
    value = text.rsplit("=", 1)[-1]
    for part in (text, value):
        part = part.strip().lstrip("$")
        if (number := _NUMBER.match(part)) and not _CONTINUES.match(part, number.end()):
            return number.group(0), part[number.end():]
    if whole or _NUMBER.match(value.strip().lstrip("$")):
        return value, ""
    return re.split(r",\s", value, maxsplit=1)[0], ""


def strip_markup(text: str) -> str:
    """`text` without markdown emphasis or code marks and LaTeX inline-math delimiters:
    "The answer is **42**." -> "The answer is 42.", "\\(x+1\\)" -> "x+1"."""
    return _MARKUP.sub("", _ITALIC.sub(r"\1", text))


def _undress(text: str) -> str:
    """`text` without LaTeX that only dresses a value: "\\text{ cm}" -> " cm", "50\\%" ->
    "50%", "1\\,000" -> "1000", "\\left(" -> "(", "12^\\circ" -> "12"; a Unicode minus
    sign becomes "-"."""
    for pattern, repl in _DRESS:
        text = pattern.sub(repl, text)
    return text


def _bold_number(text: str) -> tuple[str, str, str] | None:
    """(number as written, text before, text after) of the last emphasised span (`**X**`
    or `__X__`) that is a number."""
    for match in reversed(list(_BOLD.finditer(text))):
        span = (match[1] or match[2]).strip().rstrip(".").strip()
        if _NUMBER.fullmatch(span.strip("$")) and parse_number(span) is not None:
            return span, text[:match.start()], text[match.end():]
    return None


def _statement(plain: str) -> tuple[str, str, str] | None:
    """(answer, text before, text after) of the explicit statement a response ends on: the
    last `\\boxed{X}`; else the last "answer is X" or "#### X" whose answer has a digit
    ("answer is 12. ... this answer is correct" -> "12"); else the last "answer is", else
    the last "####"."""
    start = plain.rfind(_BOXED)
    if start >= 0 and (content := last_boxed(plain)) is not None:
        answer, rest = ((content, "") if parse_number(content) is not None
                        else _leading_answer(content, whole=True))
        return answer, plain[:start], rest + plain[start + len(_BOXED) + len(content) + 1:]
    found = []  # (has a digit, priority, position, answer, rest, where the text after starts)
    for priority, pattern in ((1, _ANSWER_IS), (0, _HASHES)):
        for match in pattern.finditer(plain):
            sentence = _SENTENCE_END.split(match[1], maxsplit=1)[0]
            answer, rest = _leading_answer(sentence)
            digit = any(c.isdigit() for c in answer)
            found.append((digit, 0 if digit else priority, match.start(), answer, rest,
                          match.start(1) + len(sentence)))
    if not found:
        return None
    _, _, position, answer, rest, after = max(found)
    return answer, plain[:position], rest + plain[after:]


def _retracted(answer: str, after: str) -> bool:
    """Whether a retraction follows a numeric `answer` and then only other numbers ("12.
    Wait, actually it is 13."); a check that restates it ("Wait: 3 * 4 = 12") is none."""
    value, retraction = parse_number(answer), _RETRACT.search(after)
    if value is None or retraction is None:
        return False
    later = [parse_number(n) for n in _NUMBER.findall(after[retraction.end():])]
    later = [n for n in later if n is not None]
    return bool(later) and value not in later


def final_answer(response: str) -> str | None:
    """The final answer a response states: an explicit statement (the last `\\boxed{X}`,
    else the last "answer is X" or "#### X"; see `_statement`), else the last emphasised
    number ("**42**"), else the last number. A statement's answer is the number it starts
    with, or ends on after "=" ("17 + 25 = 42"), unless that number starts an expression
    ("12 + 5", "2^3", "12, 13"). None when the answer is offered as one of alternatives
    ("12 or 13", "12, or maybe 13") or retracted ("12. Wait, it is 13."). Markdown
    emphasis, LaTeX inline delimiters and LaTeX dress (`\\text{ cm}`, `\\%`, `\\left(`)
    are ignored."""
    plain = _undress(strip_markup(response))
    found = _statement(plain) or _bold_number(_undress(response))
    if found is None and (numbers := list(_NUMBER.finditer(plain))):
        last = numbers[-1]
        found = last[0], plain[:last.start()], plain[last.end():]
    if found is None:
        return None
    answer, before, after = found
    if _OR_BEFORE.search(before) or _OR_AFTER.match(after) or _retracted(answer, after):
        return None
    return answer


def _last_line(response: str) -> str:
    """The last non-empty line of a response, without markup or edge punctuation."""
    lines = [line for line in strip_markup(response).splitlines() if line.strip()]
    return lines[-1].strip(_WORD_EDGE) if lines else ""


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().rstrip(".").strip("$")).lower()


@register_verifier("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1.0 when response and answer are equal after stripping surrounding whitespace."""
    return 1.0 if response.strip() == answer.strip() else 0.0


@register_verifier("numeric")
def numeric(response: str, answer: str, rel_tol: float | None = None,
            abs_tol: float | None = None) -> float:
    """1.0 when the last number of the response is within tolerance of the answer.

    By default a whole-number answer must be matched within float noise (1e-6, so a
    computed 12.000000000000002 counts), never a relative share, which took 1234001 for
    1234000; any other answer within a relative 1e-6 (or 1e-9 absolute near zero). Raises
    ValueError when the answer itself is not a number (a data error, not the model's).
    """
    expected = parse_number(answer)
    if expected is None:
        raise ValueError(f"answer {answer!r} is not a number")
    whole = expected.denominator == 1
    rel_tol = (0.0 if whole else 1e-6) if rel_tol is None else rel_tol
    abs_tol = (1e-6 if whole else 1e-9) if abs_tol is None else abs_tol
    got = last_number(response)
    if got is None:
        return 0.0
    # math.isclose's rule on the exact values: no float rounding (1e20 + 1 is not 1e20) and
    # no overflow (1e400)
    bound = max(Fraction(rel_tol) * max(abs(got), abs(expected)), Fraction(abs_tol))
    return 1.0 if abs(got - expected) <= bound else 0.0


@register_verifier("math_final_answer")
def math_final_answer(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference.

    The final answer is the one `final_answer` reads: a stated one (`\\boxed{}`, "answer
    is", "####"), else the last number. A hedge ("12 or 13"), a retraction ("12. Wait, it
    is 13.") or an expression where a number is expected ("12 + 5", "2\\sqrt{2}") earns
    0.0. Numbers compare exactly as fractions (`0.5` == `1/2` == `\\frac{1}{2}`,
    `1,000` == `1000`, `12.0` == `12`; `-5` != `5`), after any unit or `%` that follows
    them ("12 cm", "\\boxed{50\\%}"); anything else compares as text without spaces,
    markup, LaTeX dress (`\\text{}`), `$` or a final period. A reference that is not a
    number is also found as the last line of a response that states no final answer
    ("dbga", "The word is **dbga**."): the whole line, or its last words as many as the
    reference has.
    """
    answer = _undress(answer)
    expected = parse_number(answer)
    stated = final_answer(response)
    if stated is not None:
        if expected is not None:
            return 1.0 if parse_number(stated) == expected else 0.0
        if _normalise(strip_markup(stated)) == _normalise(answer):
            return 1.0
    if expected is not None or _states_answer(response):
        return 0.0
    # a text reference, and no explicit answer: the last line, or as many last words
    line, want = _last_line(response), answer.lower().split()
    tail = [w.strip(_WORD_EDGE).lower() for w in line.split()][-len(want):] if want else []
    return 1.0 if want and (_normalise(line) == _normalise(answer) or tail == want) else 0.0


def _states_answer(response: str) -> bool:
    """Whether the response marks an answer explicitly (boxed, "answer is", "####")."""
    plain = strip_markup(response)
    return last_boxed(response) is not None or bool(_ANSWER_IS.search(plain)
                                                     or _HASHES.search(plain))


VERIFIERS["python_exec"] = python_exec_verifier(SandboxLimits())


def _split_dotted(path: str) -> tuple[str, str]:
    """(module, attribute) of `package.module:function`; VerifierError for anything else."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise VerifierError(
            f"verifier {path!r} is neither a registered name ({', '.join(sorted(VERIFIERS))}) "
            "nor a dotted path `package.module:function`"
        )
    return module_name, attr


def resolve_dotted(path: str) -> Verifier:
    """Import `package.module:function` (the function may be `Class.attr`)."""
    module_name, attr = _split_dotted(path)
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise VerifierError(f"cannot load verifier {path!r}: {exc}") from exc
    if not callable(target):
        raise VerifierError(f"verifier {path!r} is not callable")
    return target


def locate_dotted(path: str) -> str:
    """`path` (`package.module:function`) once its module is found on the import path,
    without running any code of it: the packages on the way are looked into, not imported
    (`import_module` or `find_spec` would run their `__init__` here, outside the sandbox)."""
    module_name, _ = _split_dotted(path)
    parts = module_name.split(".")
    where = None  # the import path, then each package's own folders
    for i in range(len(parts)):
        try:
            found = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), where)
        except (ImportError, ValueError) as exc:
            raise VerifierError(f"cannot load verifier {path!r}: {exc}") from exc
        if found is None:
            raise VerifierError(f"cannot load verifier {path!r}: no module named "
                                f"{module_name!r}")
        where = found.submodule_search_locations
        if where is None and i < len(parts) - 1:
            raise VerifierError(f"cannot load verifier {path!r}: {parts[i]!r} is not a package")
    return path


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
    if sandboxed and spec not in VERIFIERS:
        # never imported here: its module's own code is as untrusted as its function
        return sandboxed_verifier(locate_dotted(spec), limits)
    fn = VERIFIERS.get(spec) or resolve_dotted(spec)
    if not sandboxed:
        return fn
    return sandboxed_verifier(dotted_path_of(fn), limits)


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
