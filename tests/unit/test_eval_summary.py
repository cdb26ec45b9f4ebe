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
    sqrt(2 x (0.5625 x 0.0625 + 0.0625 x 0.5625)) = sqrt(0.140625) = 0.375."""
    se = standard_error(np.array([1.0, 1.0, 1.0, 0.0]), ["a", "a", "a", "b"])
    assert se == pytest.approx(math.sqrt(2 * 2 * 0.5625 * 0.0625))
    assert summarize(_table(["a", "a", "a", "b"], [True, True, True, False]))["pass_at_1"] == 0.75


def test_one_prompt_has_no_error_and_the_figures_without_one_print_bare():
    s = summarize(_table(["a", "a"], [True, False]))
    assert "pass_at_1_se" not in s and "mean_reward_se" not in s
    assert plus_minus(s, "pass_at_1") == ""
    assert plus_minus({"pass_at_1_se": 0.0312}, "pass_at_1") == " ± 0.031"


def test_an_episode_needs_room_for_one_token_a_single_turn_for_its_budget():
    """An episode's first turn takes the room left in the context (`episodes._first_turn`);
    a single-turn evaluation needs its whole `max_new_tokens`."""
    from types import SimpleNamespace

    from shardrl.config import ConfigError
    from shardrl.stages.engine import PolicyEngine
    from shardrl.stages.evaluate import _check_fit
    from shardrl.tasks.builtin import TaskItem

    def ctx(environment):
        eval_cfg = SimpleNamespace(max_new_tokens=8)
        return SimpleNamespace(cfg=SimpleNamespace(
            eval_max_new_tokens=8, eval=eval_cfg, task=SimpleNamespace(environment=environment)))

    items = [TaskItem("short", "1+1=", "2", "add"), TaskItem("long", "x" * 30, "0", "add")]
    ids = [[1] * 5, [1] * 30]  # a context of 32: 5 + 8 fits, 30 + 8 does not, 30 + 1 does
    class Engine:  # the engine's context and its own fit rule, without a model
        fits = PolicyEngine.fits

        def __init__(self, context):
            self.context = context

    engine = Engine(32)
    _check_fit(ctx("calculator"), engine, items, ids)  # no error
    with pytest.raises(ConfigError, match=r"1 of 2 .* room for 8 new token\(s\) .*: long "
                                          r"\(30 tokens\)"):
        _check_fit(ctx(None), engine, items, ids)
    with pytest.raises(ConfigError, match=r"room for 1 new token\(s\) .*: long \(32 tokens\)"):
        _check_fit(ctx("calculator"), engine, items, [[1] * 5, [1] * 32])
    _check_fit(ctx(None), Engine(None), items, ids)  # no context: no limit
