"""Verifiers: registry, answer extraction, and failures turned into reward 0 with a reason."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardrl.tasks.verifiers import (
    VerifierError,
    exact_match,
    final_answer,
    get_verifier,
    last_number,
    math_final_answer,
    numeric,
    parse_number,
    run_verifier,
)


def test_exact_match_strips_whitespace_only():
    assert exact_match("  432\n", "432") == 1.0
    assert exact_match("432.", "432") == 0.0
    assert exact_match("Paris", "paris") == 0.0


def test_parse_number_forms():
    assert parse_number("1,234") == 1234
    assert parse_number("-0.5") == Fraction(-1, 2)
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("$2e3$.") == 2000
    assert parse_number("12{,}345") == 12345  # LaTeX's thousands separator
    assert parse_number("x+1") is None
    assert parse_number("1/0") is None


def test_last_number_takes_the_last_one():
    assert last_number("3 apples and 1,250.5 pears") == Fraction(2501, 2)
    assert last_number("10-3 is 7") == 7
    assert last_number("no digits") is None


def test_numeric_tolerance():
    assert numeric("so it is 3.1415927", "3.14159265") == 1.0  # relative error 1.6e-8 < 1e-6
    assert numeric("so it is 3.14", "3.14159265") == 0.0  # relative error 5e-4
    assert numeric("1,000", "1000") == 1.0
    assert numeric("nothing", "5") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        numeric("5", "five")


def test_numeric_whole_number_answers_take_no_relative_tolerance():
    """A relative 1e-6 took 1234001 for 1234000: a whole-number answer is matched within
    float noise only, on the exact values (as floats 1e20 + 1 and 1e20 are one number)."""
    assert numeric("1234001", "1234000") == 0.0
    assert numeric("12.000000000000002", "12") == 1.0  # a computed value's float noise
    assert numeric("100000000000000000001", "1e20") == 0.0
    assert numeric("1e20", "100000000000000000000") == 1.0
    assert numeric("1234000.5", "1234000") == 0.0
    # other answers keep the relative rule; a caller's own tolerance wins
    assert numeric("1234000.51", "1234000.5") == 1.0  # relative error 8e-9
    assert numeric("1234001", "1234000", rel_tol=1e-6) == 1.0
    assert numeric("0.0000000001", "0") == 1.0 and numeric("0.00001", "0") == 0.0


def test_final_answer_priority():
    # boxed beats "answer is" and "####" (the last of them that states a number), which beat
    # the last number.
    assert final_answer("answer is 3, but \\boxed{\\frac{1}{2}} and 9") == "\\frac{1}{2}"
    assert final_answer("#### 5\nThe answer is 1,000 apples. Then 7") == "1,000"
    assert final_answer("work 3 + 4\n#### 72") == "72"
    assert final_answer("we get 3 then 8") == "8"
    assert final_answer("\\boxed{a{b}c}") == "a{b}c"
    assert final_answer("no answer here") is None


def test_math_final_answer_normalises():
    assert math_final_answer("The answer is $\\frac{3}{4}$.", "0.75") == 1.0
    assert math_final_answer("\\boxed{1,000}", "1000") == 1.0
    assert math_final_answer("\\boxed{2/4}", "1/2") == 1.0
    assert math_final_answer("answer is x + 1, clearly", "X+1") == 1.0
    assert math_final_answer("\\boxed{0.33}", "1/3") == 0.0
    assert math_final_answer("nothing", "1") == 0.0


def test_get_verifier_by_name_and_dotted_path():
    assert get_verifier("exact_match") is exact_match
    assert get_verifier("shardrl.tasks.verifiers:numeric") is numeric
    with pytest.raises(VerifierError, match="neither a registered name"):
        get_verifier("no_such_verifier")
    with pytest.raises(VerifierError, match="cannot load verifier"):
        get_verifier("shardrl.tasks.verifiers:missing")


def test_run_verifier_never_raises():
    def boom(response, answer):
        raise RuntimeError("bad regex")

    assert run_verifier(exact_match, "1", "1") == (1.0, None)
    assert run_verifier(boom, "1", "1") == (0.0, "RuntimeError: bad regex")
    assert run_verifier(lambda r, a: float("nan"), "1", "1") == (
        0.0,
        "verifier returned non-finite nan",
    )
    assert run_verifier(lambda r, a: "1.0", "1", "1") == (
        0.0,
        "verifier returned str, expected a float",
    )
    assert run_verifier(lambda r, a: True, "1", "1") == (1.0, None)
    assert run_verifier(numeric, "5", "five") == (0.0, "ValueError: answer 'five' is not a number")


def test_chat_answers_are_extracted():
    cases = {
        "The answer is 42.": 1.0,
        "**42**": 1.0,
        "= 42": 1.0,
        "17 + 25 = 42.": 1.0,
        "The answer is **42**.": 1.0,
        "**42** is the sum of 17 and 25": 1.0,  # an emphasised number beats the last one
        "The answer is 17+25 = 42.": 1.0,  # "answer is" an equation: its result
        "The answer is \\(42\\).": 1.0,
        "Answer: `42`": 1.0,
        "The answer is 5+38 = 43.": 0.0,
        "17 + 25 = 32.": 0.0,
        "I am not sure.": 0.0,
    }
    assert {text: math_final_answer(text, "42") for text in cases} == cases
    # a text answer: stated explicitly, or the last words of the last line
    assert math_final_answer("The answer is dbga.", "dbga") == 1.0
    assert math_final_answer("Shift each letter:\nThe word is **dbga**.", "dbga") == 1.0
    assert math_final_answer("dbga", "dbga") == 1.0
    assert math_final_answer("The answer is not dbga", "dbga") == 0.0
    assert math_final_answer("dbgb", "dbga") == 0.0
    assert math_final_answer("It is New York.", "New York") == 1.0


def test_a_huge_exponent_is_not_a_number_and_costs_nothing():
    """`Fraction("1e999999999")` computes 10**999999999: hours for one short response."""
    import time

    from shardrl.tasks.builtin import TaskItem
    from shardrl.tasks.environments import make_environment

    started = time.monotonic()
    assert parse_number("1e999999999") is None and parse_number("-2.5E-00000099999") is None
    assert parse_number("1e1000") == Fraction(10) ** 1000
    assert parse_number("2.5e-3") == Fraction(1, 400)
    assert math_final_answer("The answer is 1e999999999", "42") == 0.0
    assert numeric("1e3000000, then 42", "42") == 1.0  # the last number that is one
    assert numeric("42 then 1e3000000", "42") == 1.0
    calc = make_environment("calculator")
    calc.reset(TaskItem("c", "17+25", "42", "calc"))
    assert calc.step("answer: 1e3000000").reward == 0.0
    assert time.monotonic() - started < 1.0


def test_math_final_answer_misreads():
    """As a careful grader reads them: a hedge or a retraction states no answer, a number
    that goes on into an expression or a longer number is not the answer, and LaTeX that
    only dresses a value is ignored."""
    cases = {
        # offered as one of alternatives: no single answer
        ("The answer is 12 or 13.", "12"): 0.0,
        ("The answer is 12, or maybe 13.", "12"): 0.0,
        ("The answer is 12 (or 13).", "12"): 0.0,
        ("The answer is 12, 13, or 14.", "12"): 0.0,
        ("#### 12 or 13", "12"): 0.0,
        ("It could be \\boxed{12} or \\boxed{13}", "13"): 0.0,
        ("**12** or **13**", "13"): 0.0,
        ("the sum is 12 or 13", "13"): 0.0,
        # a number that goes on into an expression or a longer number is not the answer
        ("The answer is 12 + 5.", "12"): 0.0,
        ("The answer is 2^3.", "2"): 0.0,
        ("The answer is 2\\sqrt{2}.", "2"): 0.0,
        ("The answer is 3\\frac{1}{2}.", "3"): 0.0,
        ("The answer is 12:30.", "12"): 0.0,
        ("The answer is 1,00.", "1"): 0.0,
        ("The answer is 12,5.", "12"): 0.0,
        ("The answer is 1 000.", "1"): 0.0,
        ("The answer is 1 000.", "1000"): 1.0,
        ("The answer is 3 / 4.", "0.75"): 1.0,
        ("The answer is 1/2/3.", "1/2"): 0.0,
        ("The answer is 5, because x = 12 - 7.", "12"): 0.0,  # an "=" further on
        ("The answer is 5, because x = 12 - 7.", "5"): 1.0,
        # stated, then taken back or stated again
        ("The answer is 12. Wait, actually it is 13.", "12"): 0.0,
        ("The answer is 12.\nWait, I made a mistake: 3 * 5 = 15.", "12"): 0.0,
        ("\\boxed{12}\nOops, that is wrong: 3 * 5 = 15.", "12"): 0.0,
        ("The answer is 12.\n#### 13", "12"): 0.0,
        ("The answer is 12.\n#### 13", "13"): 1.0,
        ("The answer is 12.\nI am sure this answer is correct.", "12"): 1.0,
        # LaTeX dress, units, a Unicode minus sign
        ("\\boxed{12 \\text{ cm}}", "12"): 1.0,
        ("\\boxed{50\\%}", "50"): 1.0,
        ("\\boxed{\\$12}", "12"): 1.0,
        ("\\boxed{1\\,000}", "1000"): 1.0,
        ("\\boxed{12^\\circ}", "12"): 1.0,
        ("\\boxed{x = 5}", "5"): 1.0,
        ("\\boxed{\\left(\\frac{1}{2}\\right)}", "1/2"): 1.0,
        ("The answer is \u22125.", "-5"): 1.0,
    }
    assert {case: math_final_answer(*case) for case in cases} == cases
    assert final_answer("The answer is 12 or 13.") is None
    assert final_answer("The answer is 12 + 5.") == "12 + 5"
    assert parse_number("3\\frac{1}{2}") is None and parse_number("4 2") is None
    assert parse_number("1 000") == 1000


def test_math_final_answer_keeps_plain_readings():
    """Units, `12.0`, signs, and a later check or restatement of the same value."""
    cases = {
        ("The answer is 12 cm.", "12"): 1.0,
        ("The answer is 12.0", "12"): 1.0,
        ("The answer is 42.000001", "42"): 0.0,
        ("The answer is 50%.", "50"): 1.0,
        ("The answer is -5.", "5"): 0.0,
        ("\\boxed{-5}", "-5"): 1.0,
        ("The answer is 1,000 apples.", "1000"): 1.0,
        ("The answer is 17 apples, since 12 + 5 = 17.", "17"): 1.0,
        ("The answer is 2 hours or 120 minutes.", "2"): 1.0,  # the same value, restated
        ("Since 3 or 4 friends come, the total is 12.", "12"): 1.0,
        ("The answer is 17.\nWait, let me check: 20 - 3 = 17. Yes.", "17"): 1.0,
        ("\\boxed{12}\nWait, actually \\boxed{13}", "13"): 1.0,
        ("\\boxed{17}\n\nI hope this answer is helpful!", "17"): 1.0,
        ("\\boxed{(1, 2)}", "(1,2)"): 1.0,
        ("\\boxed{\\text{(C)}}", "\\text{(C)}"): 1.0,
        ("\\boxed{x^2+1}", "x^2+1"): 1.0,
    }
    assert {case: math_final_answer(*case) for case in cases} == cases
