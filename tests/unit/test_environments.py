"""Environments (the interface, the registry, the calculator) and the token masks of
hand-built multi-turn episodes, down to the learner's loss."""

from __future__ import annotations

import os
from fractions import Fraction

import pyarrow as pa
import pytest
import torch

from shardrl.config import load_config
from shardrl.stages.batch import build_batch
from shardrl.stages.update import compute_loss
from shardrl.tasks.builtin import TaskItem
from shardrl.tasks.environments import (
    MAX_TOOL_OUTPUT,
    Calculator,
    EnvironmentSpecError,
    PythonTool,
    Turn,
    calculate,
    episode_tokens,
    make_environment,
)
from shardrl.tasks.sandbox import SandboxLimits

ITEM = TaskItem(prompt_id="p1", prompt="Ann has 17 apples and buys 25 more. How many?",
                answer="42", category="calc")


def test_calculate_parses_arithmetic_and_executes_nothing():
    assert calculate("3 * (4 + 5) / 2") == Fraction(27, 2)
    assert calculate("-2.5 + 1") == Fraction(-3, 2)
    for bad in ("__import__('os')", "2 ** 10", "x + 1", "abs(-1)", "1 / 0", "(1", "9" * 13,
                "1" + "+1" * 40):
        with pytest.raises(ValueError):
            calculate(bad)


def test_calculator_episode():
    env = make_environment("calculator")
    assert isinstance(env, Calculator) and env.reset(ITEM) == ITEM.prompt
    r = env.step("I add them: calc(17 + 25)")
    assert (r.observation, r.reward, r.done) == ("= 42", 0.0, False)
    r = env.step("calc(7 / 2)")
    assert (r.observation, r.done) == ("= 3.5", False)
    r = env.step("calc(import os)")
    assert r.observation.startswith("error:") and not r.done
    assert env.step("answer: 42") == type(r)("", 1.0, True)
    env.reset(ITEM)
    assert env.step("Answer = 41").reward == 0.0
    assert env.step("I do not know") == type(r)("", 0.0, True)  # neither tool nor answer
    # a whole-number answer is matched exactly, up to a tool's float noise: a relative
    # tolerance of 1e-6 took 1234001 for 1234000
    big = TaskItem(prompt_id="p2", prompt="1233999 + 1?", answer="1234000", category="sum")
    env.reset(big)
    assert env.step("answer: 1234001").reward == 0.0
    env.reset(big)
    assert env.step("answer: 1234000.0000000002").reward == 1.0


def test_python_tool_runs_the_policys_code_in_the_sandbox(monkeypatch):
    limits = SandboxLimits(cpu_seconds=1.0, memory_mb=256, wall_seconds=2.0)
    env = make_environment("python", sandbox=limits)
    assert isinstance(env, PythonTool) and env.limits == limits
    env.reset(ITEM)
    r = env.step("Let me add.\n```python\nprint(17 + 25)\n```")
    assert (r.observation, r.reward, r.done) == ("42", 0.0, False)
    # the code runs in another process without the parent's environment
    monkeypatch.setenv("SHARDRL_TEST_SECRET", "s3cr3t")
    r = env.step("```python\nimport os\nprint(os.environ.get('SHARDRL_TEST_SECRET'), "
                 "os.getpid() != PARENT)\n```".replace("PARENT", str(os.getpid())))
    assert r.observation == "None True" and not r.done
    r = env.step("```python\nraise ValueError('bad')\n```")
    assert r.observation.startswith("error:") and "ValueError" in r.observation and not r.done
    r = env.step("```python\nwhile True:\n    pass\n```")  # stopped by the limits
    assert r.observation == "error: timeout" and not r.done
    r = env.step("```python\nprint('x' * 1000)\n```")
    assert r.observation == "x" * MAX_TOOL_OUTPUT + " [cut]"
    assert env.step("```python\nx = 1\n```").observation == "(no output)"
    assert env.step("answer: 42") == type(r)("", 1.0, True)
    env.reset(ITEM)
    assert env.step("answer: 41").reward == 0.0
    assert env.step("no code, no answer") == type(r)("", 0.0, True)


def test_an_answer_is_said_outside_code_and_an_outsized_one_is_wrong():
    """`answer = ...` inside a code block is code to run, not the turn's answer (a literal
    written into the code used to end the episode with that reward, without running it); a
    number no float holds (1e400, 400 digits) scores 0 instead of failing the stage."""
    from shardrl.tasks.environments import Guess
    from shardrl.tasks.verifiers import numeric

    limits = SandboxLimits(cpu_seconds=1.0, memory_mb=256, wall_seconds=2.0)
    item = TaskItem("p", "8 boxes of 47 eggs. total?", "376", "mul")
    env = make_environment("python", sandbox=limits)
    env.reset(item)
    r = env.step("```python\nanswer = 8 * 47\nprint(answer)\n```")
    assert (r.observation, r.reward, r.done) == ("376", 0.0, False)
    r = env.step("```python\nfinal_answer = 376\nprint(final_answer)\n```")
    assert (r.observation, r.done) == ("376", False)
    assert env.step("the code says so: answer: 376").reward == 1.0
    calc = make_environment("calculator")
    for outsized in ("answer: 1e400", "answer: " + "9" * 400):
        calc.reset(item)
        assert calc.step(outsized) == type(r)("", 0.0, True)
    assert numeric("1e400", "1e400") == 1.0 and numeric("1e400", "376") == 0.0
    guess = Guess()
    guess.reset(TaskItem("g", "guess 1-10", "5", "guess"))
    assert guess.step("guess: " + "9" * 5000) == type(r)("", 0.0, True)


def test_settings_go_only_to_environments_that_take_them():
    limits = SandboxLimits(wall_seconds=1.0)
    assert isinstance(make_environment("calculator", sandbox=limits), Calculator)
    assert make_environment("python").limits == SandboxLimits()  # the defaults


class NoStep:
    def reset(self, item):
        return ""


def test_environments_by_name_or_path():
    assert isinstance(make_environment("shardrl.tasks.environments:Calculator"), Calculator)
    with pytest.raises(EnvironmentSpecError, match="calculator"):
        make_environment("abacus")
    with pytest.raises(EnvironmentSpecError):
        make_environment("shardrl.tasks.environments:Abacus")
    with pytest.raises(EnvironmentSpecError, match="step"):
        make_environment(f"{__name__}:NoStep")


def test_episode_tokens_mask_the_environments_tokens():
    # policy 5 6 | tool 9 9 9 | policy 7 | tool 10 | policy 8 (answer, episode done)
    ep = episode_tokens([Turn([5, 6], [-0.1, -0.2], [9, 9, 9], 0.0),
                         Turn([7], [-0.3], [10], 0.0),
                         Turn([8], [-0.4], [], 1.0)])
    assert ep.response_token_ids == [5, 6, 9, 9, 9, 7, 10, 8]
    assert ep.policy_mask == [1, 1, 0, 0, 0, 1, 0, 1]
    assert ep.behavior_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, -0.4]
    assert ep.turn_rewards == [0.0, 0.0, 1.0] and ep.turn_starts == [0, 5, 7]
    assert ep.episode_return == 1.0
    # cut at max_turns on the environment's reply: the reply is kept, masked out
    cut = episode_tokens([Turn([5], [-0.1], [9, 9], 0.5)])
    assert cut.policy_mask == [1, 0, 0] and cut.episode_return == 0.5
    # one turn without an observation is the single-turn layout
    one = episode_tokens([Turn([5, 6, 7], [-0.1, -0.2, -0.3])])
    assert one.policy_mask == [1, 1, 1] and one.response_token_ids == [5, 6, 7]
    with pytest.raises(ValueError):
        Turn([5, 6], [-0.1])
    with pytest.raises(ValueError):
        episode_tokens([])


def _table(responses, masks=None, prompts=None):
    n = len(responses)
    cols = {"group_id": ["g"] * n, "prompt_token_ids": prompts or [[3, 4]] * n,
            "response_token_ids": responses, "advantage": [1.0, -1.0][:n]}
    if masks is not None:
        cols["policy_mask"] = pa.array(masks, pa.list_(pa.int8()))
    return pa.table(cols)


def test_the_batch_mask_is_the_policy_mask_on_response_tokens():
    # rows of different prompt lengths: response position t of row i is start[i] + t
    table = _table([[5, 9, 9, 7], [6, 8]], [[1, 0, 0, 1], [1, 1]], [[3, 4], [3]])
    b = build_batch(table, pad_id=0)
    assert b.response_start.tolist() == [2, 1]
    assert b.response_mask.tolist() == [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]]
    plain = build_batch(table.drop_columns(["policy_mask"]), pad_id=0)
    assert plain.response_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]


def test_only_the_policys_tokens_get_loss(tiny_policy):
    """The loss of an episode with tool tokens equals the loss computed by hand on its
    policy tokens alone, whatever the tool tokens' behaviour logprobs say."""
    policy = tiny_policy
    responses, masks = [[5, 9, 9, 7], [6, 10, 8, 8]], [[1, 0, 0, 1], [1, 1, 0, 1]]
    table = _table(responses, masks)
    batch = build_batch(table, 0)
    with torch.no_grad():
        logp = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    cfg = load_config("demo", ["algo.loss={kind: cispo}", "algo.aggregation=token",
                               "algo.kl.placement=none", "algo.advantages.norm=none"])

    def loss_with(behaviour):
        t = table.append_column("behavior_logprobs", pa.array(behaviour, pa.list_(pa.float32())))
        t = t.append_column("ref_logprobs", pa.array([None] * 2, pa.list_(pa.float32())))
        return compute_loss(cfg, policy, t, 0, beta=0.0)

    on_policy = [[v if m else 0.0 for v, m in zip(row, mask, strict=True)]
                 for row, mask in zip(logp.tolist(), masks, strict=True)]
    loss, metrics, _ = loss_with(on_policy)
    # CISPO at ratio 1: -A * logprob, mean over the 5 policy tokens
    mask = torch.tensor(masks, dtype=torch.float32)
    expected = -((torch.tensor([1.0, -1.0])[:, None] * logp) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["logprob_mismatch_abs"].item() == pytest.approx(0.0, abs=1e-6)
    # the tool tokens' logprobs are never compared: garbage there changes nothing
    garbage = [[v if m else -50.0 for v, m in zip(row, mask, strict=True)]
               for row, mask in zip(on_policy, masks, strict=True)]
    loss2, metrics2, _ = loss_with(garbage)
    assert loss2.item() == loss.item()
    assert metrics2["logprob_mismatch_abs"].item() == metrics["logprob_mismatch_abs"].item()
    # and the gradient reaches the model only through the policy tokens' logprobs
    policy.zero_grad()
    loss_with(on_policy)[0].backward()
    got = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    out = policy(batch.input_ids, batch.attention_mask, batch.response_start).logprobs
    (-((torch.tensor([1.0, -1.0])[:, None] * out) * mask).sum() / mask.sum()).backward()
    for g, p in zip(got, policy.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-7)
