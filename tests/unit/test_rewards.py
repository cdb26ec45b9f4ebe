"""Composite reward: weights, reward model, overlong penalty, error counting, config mapping."""

from __future__ import annotations

import pyarrow as pa
import pytest

from shardrl.config import RunConfig
from shardrl.tasks.rewards import (
    CompositeReward,
    OverlongPenalty,
    RewardSpec,
    VerifierTerm,
    build_verifiers,
    error_count,
    overlong_penalty,
    score_batch,
    spec_from_config,
)
from shardrl.tasks.sandbox import SandboxLimits
from shardrl.tasks.verifiers import exact_match, numeric


def test_overlong_penalty_ramp():
    cfg = OverlongPenalty(max_len=16, buffer_tokens=4, penalty=2.0)
    # Ramp starts at 16 - 4 = 12 tokens: -2 * (len - 12) / 4, capped at -2.
    assert [overlong_penalty(n, cfg) for n in (5, 12, 13, 14, 16, 40)] == [
        0.0,
        0.0,
        -0.5,
        -1.0,
        -2.0,
        -2.0,
    ]


def test_score_batch_combines_weighted_terms():
    spec = RewardSpec(
        verifiers=(VerifierTerm("exact_match", 1.0), VerifierTerm("numeric", 0.5)),
        reward_model_weight=0.1,
        overlong=OverlongPenalty(max_len=10, buffer_tokens=2),
    )
    rows = score_batch(
        spec,
        build_verifiers(spec),
        responses=["7", "x 7", "8"],
        answers=["7", "7", "7"],
        response_lengths=[3, 9, 10],
        rm_scores=[2.0, -1.0, 0.0],
    )
    # row 0: exact 1 + 0.5 * numeric 1 = 1.5; + 0.1 * 2 = 1.7; length 3 -> no penalty
    # row 1: exact 0 + 0.5 * 1 = 0.5; + 0.1 * -1 = 0.4; length 9 -> -(9 - 8) / 2 = -0.5
    # row 2: 0 + 0; + 0; length 10 -> -1
    assert [r["reward_verifier"] for r in rows] == [1.5, 0.5, 0.0]
    assert [r["reward_model"] for r in rows] == [2.0, -1.0, 0.0]
    assert [r["reward_rm"] for r in rows] == pytest.approx([1.7, -0.1, -1.0])
    assert [r["correct"] for r in rows] == [True, False, False]
    assert error_count(rows) == 0


def test_errors_give_zero_and_are_counted():
    def broken(response, answer):
        raise KeyError("label")

    spec = RewardSpec(verifiers=(VerifierTerm("exact_match", 2.0), VerifierTerm("mine", 1.0)))
    rows = score_batch(spec, [exact_match, broken], ["a", "b"], ["a", "a"], [1, 1])
    assert [r["reward_rm"] for r in rows] == [2.0, 0.0]  # broken adds 0.0
    assert rows[0]["reward_error"] == "mine: KeyError: 'label'"
    assert [r["correct"] for r in rows] == [False, False]  # an error is never correct
    assert error_count(rows) == 2


def test_sandboxed_crash_is_counted(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text("def crash(r, a):\n    raise RuntimeError('oops')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = RewardSpec(
        verifiers=(VerifierTerm("rw:crash", 1.0, sandboxed=True),),
        sandbox=SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=4),
    )
    rows = score_batch(spec, build_verifiers(spec), ["x"], ["x"], [1])
    assert rows[0]["reward_rm"] == 0.0
    assert rows[0]["reward_error"] == "rw:crash: crashed: RuntimeError: oops"
    assert error_count(rows) == 1


def test_rm_scores_must_match_the_spec():
    spec = RewardSpec(verifiers=(VerifierTerm("exact_match"),))
    with pytest.raises(ValueError, match="exactly when reward_model_weight"):
        score_batch(spec, [exact_match], ["a"], ["a"], [1], rm_scores=[1.0])


def test_task_verifier_and_config_mapping():
    cfg = RunConfig.model_validate(
        {
            "reward": {
                "verifiers": [{"name": "numeric", "weight": 0.5}, {"name": "task"}],
                "overlong": {"buffer_tokens": 4, "penalty": 2.0},
                "sandbox": {"cpu_seconds": 1.0, "memory_mb": 128, "wall_seconds": 3.0},
            },
            "rollout": {"max_new_tokens": 16},
        }
    )
    spec = spec_from_config(cfg)
    assert spec == RewardSpec(
        verifiers=(VerifierTerm("numeric", 0.5), VerifierTerm("task", 1.0)),
        overlong=OverlongPenalty(max_len=16, buffer_tokens=4, penalty=2.0),
        sandbox=SandboxLimits(cpu_seconds=1.0, memory_mb=128, wall_seconds=3.0),
    )
    with pytest.raises(ValueError, match="needs the task's checker"):
        build_verifiers(spec)
    fns = build_verifiers(spec, task_verifier=exact_match)
    assert fns == [numeric, exact_match]


def test_score_table_returns_score_columns():
    spec = RewardSpec(verifiers=(VerifierTerm("exact_match"),), reward_model_weight=1.0)
    seen = []

    def rm(texts):
        seen.extend(texts)
        return [float(len(t)) for t in texts]

    table = pa.table(
        {
            "prompt_text": ["1+1=", "2+2="],
            "response_text": ["2", "5"],
            "answer": ["2", "4"],
            "response_token_ids": [[5, 2], [6, 2]],
        }
    )
    columns = CompositeReward(spec, [exact_match], rm).score_table(table)
    assert seen == ["1+1=2", "2+2=5"]  # the reward model reads prompt + response
    # reward_rm = exact match + 1.0 * len(text): 1 + 5 = 6 and 0 + 5 = 5
    assert columns == {
        "reward_verifier": [1.0, 0.0],
        "reward_model": [5.0, 5.0],
        "reward_rm": [6.0, 5.0],
        "correct": [True, False],
        "reward_error": [None, None],
    }
