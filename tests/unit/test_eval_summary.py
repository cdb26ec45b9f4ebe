"""An evaluation's summary (`evaluate.summarize`): its figures and their standard errors, on
hand-computed tables."""

import math

import numpy as np
import pyarrow as pa
import pytest

from shardrl.stages.evaluate import plus_minus, standard_error, summarize


def _table(prompts, correct, rewards=None, categories=None):
    n = len(prompts)
    return pa.table({"prompt_id": prompts, "correct": correct,
                     "reward": rewards or [float(c) for c in correct],
                     "response_length": [4] * n, "category": categories or ["add"] * n})


def test_the_error_is_the_spread_of_the_prompts_means():
    """Prompt a solved 2 of 2 times, b 0 of 2: means 1 and 0, pass@1 0.5. Over the prompts,
    sqrt(k / (k - 1) x sum w^2 (m - mean)^2) = sqrt(2 x 2 x 0.25 x 0.25) = 0.5; the four
    samples taken as independent would read sqrt(0.25 / 4) = 0.25."""
    s = summarize(_table(["a", "a", "b", "b"], [True, True, False, False]))
    assert s["pass_at_1"] == 0.5 and s["pass_at_1_se"] == pytest.approx(0.5)
    assert s["mean_reward_se"] == pytest.approx(0.5)
    # the same rate with each prompt half solved: the prompts agree, no spread between them
    s = summarize(_table(["a", "a", "b", "b"], [True, False, True, False]))
    assert s["pass_at_1"] == 0.5 and s["pass_at_1_se"] == 0.0


def test_one_sample_a_prompt_gives_the_binomial_error_with_n_minus_one():
    # 3 of 4 correct: sqrt(0.75 x 0.25 / 3) = 0.25
    assert standard_error(np.array([1.0, 1.0, 1.0, 0.0]), list("abcd")) == pytest.approx(0.25)


def test_prompts_with_more_samples_weigh_more_as_in_the_mean():
    """a: 3 samples all right, b: 1 sample wrong. Mean 0.75 with weights 3/4 and 1/4:
    sqrt(2 x (0.5625 x 0.0625 + 0.0625 x 0.5625)) = sqrt(0.0703125) = 0.2652."""
    se = standard_error(np.array([1.0, 1.0, 1.0, 0.0]), ["a", "a", "a", "b"])
    assert se == pytest.approx(math.sqrt(2 * 2 * 0.5625 * 0.0625))
    assert summarize(_table(["a", "a", "a", "b"], [True, True, True, False]))["pass_at_1"] == 0.75


def test_one_prompt_has_no_error_and_the_figures_without_one_print_bare():
    s = summarize(_table(["a", "a"], [True, False]))
    assert "pass_at_1_se" not in s and "mean_reward_se" not in s
    assert plus_minus(s, "pass_at_1") == ""
    assert plus_minus({"pass_at_1_se": 0.0312}, "pass_at_1") == " ± 0.031"
