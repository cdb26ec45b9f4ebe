"""Multi-turn episodes: the runner on scripted turns, the shard round trip of the episode
columns, episode-level group advantages and GAE over the policy's tokens (hand-computed),
the scoring of episode returns, the SFT layout of demonstrated episodes, and the guess task."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch

from shardrl.algo import get_advantage_estimator
from shardrl.algo.advantages import gae, last_masked
from shardrl.engines.base import Sample
from shardrl.stages.batch import build_batch
from shardrl.stages.episodes import episode_metrics, run_episodes, with_episode_columns
from shardrl.store.schemas import EPISODE, READY, ROLLOUT, SCORED
from shardrl.store.shards import SchemaError, conform, decode_shard, encode_shard
from shardrl.tasks.builtin import TaskItem
from shardrl.tasks.environments import Calculator, Guess
from shardrl.tasks.episodic import CalcTask, GuessTask, demonstrations
from shardrl.tasks.prompts import PromptFormat
from shardrl.tasks.rewards import CompositeReward, RewardSpec, VerifierTerm

# a toy vocabulary: one id per character, EOS = 0
CHARS = " 0123456789+-*/=():.,?'abcdefghijklmnopqrstuvwxyz"
EOS = 0


def enc(text: str) -> list[int]:
    return [CHARS.index(c) + 1 for c in text]


def dec(ids: list[int]) -> str:
    return "".join(CHARS[i - 1] for i in ids if i != EOS)


def scripted(turns: dict[int, list[str]]):
    """A generate() whose k-th call returns, for each context, the next scripted text of the
    episode it belongs to (identified by call order), with logprob -0.5 per token."""
    calls = []

    def generate(prompt_ids, n, budget, seed):
        calls.append((len(prompt_ids), n, budget, seed))
        t = len(calls) - 1
        texts = turns[t]
        out, at = [], 0
        for _ in prompt_ids:
            group = []
            for _ in range(n):
                ids = enc(texts[at])[:budget]
                stop = len(enc(texts[at])) < budget
                ids = ids + [EOS] if stop else ids
                group.append(Sample(ids, [-0.5] * len(ids), "stop" if stop else "length"))
                at += 1
            out.append(group)
        return out

    return generate, calls


ITEM = TaskItem("p", "4 boxes of 21 eggs. total?", "84", "mul")


def test_runner_lays_out_turns_with_the_policy_mask():
    # episode 0: tool, then the answer (2 turns, reward 1); episode 1: a wrong guess at once
    generate, calls = scripted({0: ["calc(4*21)", "answer: 85"], 1: ["answer: 84"]})
    (e0, e1), = run_episodes(generate, Calculator, [ITEM], [enc(ITEM.prompt)], 2, max_turns=3,
                             max_new_tokens=12, seed=7, decode=dec, encode_observation=enc)
    assert calls == [(1, 2, 12, 7), (1, 1, 12, 7 + 1_000_033)]  # turn 1: only episode 0
    act1, obs, act2 = enc("calc(4*21)") + [EOS], enc("= 84"), enc("answer: 84") + [EOS]
    assert e0.token_ids == act1 + obs + act2
    assert e0.policy_mask == [1] * 11 + [0] * 4 + [1] * 11
    assert e0.logprobs == [-0.5] * 11 + [0.0] * 4 + [-0.5] * 11
    assert (e0.turn_rewards, e0.turn_starts, e0.finish_reason) == ([0.0, 1.0], [0, 15], "stop")
    assert e0.episode_return == 1.0
    assert e1.token_ids == enc("answer: 85") + [EOS] and e1.policy_mask == [1] * 11
    assert (e1.turn_rewards, e1.turn_starts, e1.finish_reason) == ([0.0], [0], "stop")


def test_runner_cuts_at_max_turns_and_at_the_context():
    # the tool is called every turn: cut after 2 turns, nothing after the last one
    generate, _ = scripted({0: ["calc(1+1)"], 1: ["calc(2+2)"]})
    (e,), = run_episodes(generate, Calculator, [ITEM], [enc(ITEM.prompt)], 1, max_turns=2,
                         max_new_tokens=12, seed=0, decode=dec, encode_observation=enc)
    assert e.token_ids == enc("calc(1+1)") + [EOS] + enc("= 2") + enc("calc(2+2)") + [EOS]
    assert e.policy_mask == [1] * 10 + [0] * 3 + [1] * 10
    assert (e.turn_rewards, e.finish_reason) == ([0.0, 0.0], "length")
    # a context of prompt + 15 tokens: turn 0 fills 10 + 3, turn 1 gets a budget of 2
    prompt = enc(ITEM.prompt)
    generate, calls = scripted({0: ["calc(1+1)"], 1: ["calc(2+2)"]})
    (e,), = run_episodes(generate, Calculator, [ITEM], [prompt], 1, max_turns=3,
                         max_new_tokens=12, seed=0, decode=dec, encode_observation=enc,
                         context=len(prompt) + 15)
    assert calls[1][2] == 2 and len(e.token_ids) == 15
    assert e.policy_mask[-2:] == [1, 1] and e.finish_reason == "length"


def test_a_reply_that_would_fill_the_context_ends_the_episode_without_it():
    """Appended, the reply would leave no room for a token (or outgrow the context): the
    episode ends on the turn before it, and its row fits the context."""
    prompt = enc(ITEM.prompt)
    for room in (12, 13):  # turn 0 takes 10 tokens, its reply "= 2" 3: 13 leave no room
        generate, calls = scripted({0: ["calc(1+1)"], 1: ["answer: 2"]})
        (e,), = run_episodes(generate, Calculator, [ITEM], [prompt], 1, max_turns=3,
                             max_new_tokens=12, seed=0, decode=dec, encode_observation=enc,
                             context=len(prompt) + room)
        assert e.token_ids == enc("calc(1+1)") + [EOS] and len(calls) == 1
        assert (e.turn_rewards, e.finish_reason) == ([0.0], "length")
        assert len(prompt) + len(e.token_ids) <= len(prompt) + room


def test_an_episode_near_the_context_end_does_not_shorten_the_others():
    # episode 0 gets a long error reply and has 5 tokens of room left; episode 1 the full 12
    short, long = TaskItem("a", "1 eggs, 2 more. total?", "3", "add"), ITEM
    prompts = [enc(short.prompt), enc(long.prompt)]
    generate, calls = scripted({0: ["calc(x)", "calc(1+2)"], 1: ["answer: 84"],
                                2: ["answer: 3"]})
    error = "error: not an arithmetic expression: 'x'"
    context = len(prompts[0]) + 8 + len(error) + 5
    room0 = 5
    assert context - len(prompts[1]) - 10 - 3 >= 12
    (e0,), (e1,) = run_episodes(generate, Calculator, [short, long], prompts, 1, max_turns=2,
                                max_new_tokens=12, seed=5, decode=dec,
                                encode_observation=enc, context=context)
    # the full budget first (episode 1), then the small room (episode 0) with its own seed
    assert calls[1:] == [(1, 1, 12, 5 + 1_000_033), (1, 1, room0, 5 + 1_000_033 + room0)]
    assert e1.token_ids[-11:] == enc("answer: 84") + [EOS] and e1.finish_reason == "stop"
    assert e0.token_ids[-room0:] == enc("answer: 3")[:room0] and e0.finish_reason == "length"


def test_a_long_prompt_does_not_shorten_the_others_first_turn():
    """Turn 0 gave every episode the room the longest prompt left (evaluation does not drop
    long held-out prompts as rollout does)."""
    short, long = TaskItem("a", "1+2?", "3", "add"), ITEM
    prompts = [enc(short.prompt), enc(long.prompt)]
    context = len(prompts[1]) + 4  # the long prompt leaves 4 tokens, the short one 26
    generate, calls = scripted({0: ["answer: 3"], 1: ["answer: 84"]})
    (e0,), (e1,) = run_episodes(generate, Calculator, [short, long], prompts, 1, max_turns=2,
                                max_new_tokens=12, seed=5, decode=dec,
                                encode_observation=enc, context=context)
    # the full budget for the short prompt (its own seed unchanged), 4 for the long one
    assert calls == [(1, 1, 12, 5), (1, 1, 4, 9)]
    assert e0.token_ids == enc("answer: 3") + [EOS] and e0.episode_return == 1.0
    assert e1.token_ids == enc("answ") and e1.finish_reason == "length"


def test_a_turn_cut_at_its_budget_ends_the_episode():
    """The environment's reply would follow a turn the policy never closed (no end of turn
    in the transcript): the episode ends there, unless the turn ended it."""
    generate, calls = scripted({0: ["calc(4*21) and then more", "answer: 84 is it"]})
    (cut, answered), = run_episodes(generate, Calculator, [ITEM], [enc(ITEM.prompt)], 2,
                                    max_turns=3, max_new_tokens=12, seed=0, decode=dec,
                                    encode_observation=enc)
    assert len(calls) == 1  # no second turn
    assert cut.token_ids == enc("calc(4*21) a") and cut.policy_mask == [1] * 12
    assert (cut.turn_rewards, cut.finish_reason) == ([0.0], "length")
    assert answered.turn_rewards == [1.0] and answered.finish_reason == "length"


def test_a_prompt_without_room_in_the_context_is_an_error():
    generate, _ = scripted({0: ["answer: 84"]})
    prompt = enc(ITEM.prompt)
    with pytest.raises(ValueError, match="fills the model's context of 26"):
        run_episodes(generate, Calculator, [ITEM], [prompt], 1, max_turns=2, max_new_tokens=8,
                     seed=0, decode=dec, encode_observation=enc, context=len(prompt))


def test_runner_requires_the_prompt_as_first_observation():
    class Other(Calculator):
        def reset(self, item):
            return "something else"

    generate, _ = scripted({0: ["answer: 84"]})
    with pytest.raises(ValueError, match="first observation"):
        run_episodes(generate, Other, [ITEM], [enc(ITEM.prompt)], 1, max_turns=2,
                     max_new_tokens=8, seed=0, decode=dec, encode_observation=enc)


def _rollout_table(samples) -> pa.Table:
    n = len(samples)
    cols = {
        "prompt_id": ["p"] * n, "group_id": ["g"] * n, "sample_idx": list(range(n)),
        "policy_version": [0] * n, "worker": [0] * n, "prompt_text": [ITEM.prompt] * n,
        "prompt_token_ids": [[1, 2, 3]] * n,
        "response_token_ids": [s.token_ids for s in samples],
        "behavior_logprobs": [s.logprobs for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "response_text": [dec(s.token_ids) for s in samples], "answer": ["84"] * n,
        "category": ["mul"] * n, "created_at": [0.0] * n,
    }
    return with_episode_columns(pa.table(cols), samples)


def _two_episodes():
    generate, _ = scripted({0: ["calc(4*21)", "answer: 85"], 1: ["answer: 84"]})
    return run_episodes(generate, Calculator, [ITEM], [enc(ITEM.prompt)], 2, max_turns=3,
                        max_new_tokens=12, seed=7, decode=dec, encode_observation=enc)[0]


def test_episode_columns_round_trip_through_every_boundary_schema():
    table = _rollout_table(_two_episodes())
    out = decode_shard(encode_shard(table, ROLLOUT), ROLLOUT)
    assert out.column_names == ROLLOUT.names + EPISODE.names
    assert out.column("policy_mask").type == pa.list_(pa.int8())
    assert out.column("policy_mask").to_pylist()[0] == [1] * 11 + [0] * 4 + [1] * 11
    assert out.column("turn_rewards").to_pylist() == [[0.0, 1.0], [0.0]]
    assert out.column("turn_starts").to_pylist() == [[0, 15], [0]]
    # score appends its columns after the episode's: they come back at the end
    scored = out
    for f in list(SCORED)[len(ROLLOUT):]:
        scored = scored.append_column(f, pa.nulls(2, f.type) if f.nullable else
                                      pa.array([1.0, 0.0] if f.name != "correct" else
                                               [True, False], type=f.type))
    back = decode_shard(encode_shard(scored, SCORED), SCORED)
    assert back.column_names == SCORED.names + EPISODE.names
    assert back.column("turn_rewards").to_pylist() == [[0.0, 1.0], [0.0]]
    # a single-turn table is unchanged; a partial set of episode columns is an error
    single = table.drop_columns(EPISODE.names)
    assert decode_shard(encode_shard(single, ROLLOUT), ROLLOUT).column_names == ROLLOUT.names
    with pytest.raises(SchemaError, match=r"missing \['turn_starts'\]"):
        conform(table.drop_columns(["turn_starts"]), ROLLOUT)
    with pytest.raises(SchemaError, match="policy_mask"):
        conform(table.set_column(table.column_names.index("policy_mask"), "policy_mask",
                                 pa.array([["x"], ["y"]])), ROLLOUT)
    assert READY.names[: len(ROLLOUT)] == ROLLOUT.names


def test_episode_return_is_the_task_verifiers_value_and_metrics():
    table = _rollout_table(_two_episodes())
    spec = RewardSpec(verifiers=(VerifierTerm("task"),))
    never = lambda response, answer: 0.0  # noqa: E731 (the text checker is not asked)
    scores = CompositeReward(spec, [never]).score_table(table)
    assert scores["reward_rm"] == [1.0, 0.0] and scores["correct"] == [True, False]
    m = episode_metrics(table)
    assert m["turns_mean"] == 1.5 and m["turns_max"] == 2.0
    assert m["policy_token_frac"] == pytest.approx(33 / 37)
    assert m["episode_return_mean"] == 0.5
    assert episode_metrics(table.drop_columns(EPISODE.names)) == {}


def test_episode_level_group_advantages_on_policy_tokens_only():
    table = _rollout_table(_two_episodes())
    batch = build_batch(table, pad_id=0)
    mask = batch.response_mask  # (2, 26)
    assert mask[0].tolist() == [1.0] * 11 + [0.0] * 4 + [1.0] * 11
    assert mask[1].tolist() == [1.0] * 11 + [0.0] * 15
    adv, _ = get_advantage_estimator("group")(torch.tensor([1.0, 0.0]), mask,
                                              group_ids=torch.tensor([0, 0]), norm="none")
    assert adv[0].tolist() == [0.5] * 11 + [0.0] * 4 + [0.5] * 11
    assert adv[1].tolist() == [-0.5] * 11 + [0.0] * 15


def test_gae_skips_the_environments_tokens():
    # policy tokens at t = 0, 1, 4, 5; the environment's at 2, 3 (their values ignored)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.3, 0.2]])
    rewards = torch.tensor([[0.0, 0.0, 7.0, 0.0, 0.0, 1.0]])  # the 7 is on a masked token
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # by hand, gamma*lam = 0.45:
    # t5: 1 - 0.2 = 0.8; t4: 0.9*0.2 - 0.3 + 0.45*0.8 = 0.24
    # t1: 0.9*0.3 - 0.4 + 0.45*0.24 = -0.022; t0: 0.9*0.4 - 0.5 + 0.45*(-0.022) = -0.1499
    expected = [-0.1499, -0.022, 0.0, 0.0, 0.24, 0.8]
    assert adv[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.3501, 0.378, 0.0, 0.0, 0.54, 1.0], abs=1e-6)
    # a contiguous mask (one turn) is the usual GAE: t1: 1 - 0.4 = 0.6; t0: 0.36 - 0.5 + 0.27
    one, _ = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.4, 0.0]]),
                 torch.tensor([[1.0, 1.0, 0.0]]), gamma=0.9, lam=0.5)
    assert one[0].tolist() == pytest.approx([0.13, 0.6, 0.0], abs=1e-6)


def test_gae_sequence_reward_lands_on_the_last_policy_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert last_masked(mask).tolist() == [1, 2, 0]
    values = torch.zeros(3, 4)
    adv, _ = get_advantage_estimator("gae")(torch.tensor([1.0, 2.0, 3.0]), mask, values=values,
                                            gamma=1.0, lam=1.0)
    assert adv.tolist() == [[1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 2.0, 0.0], [0.0] * 4]


def test_sft_rows_of_demonstrated_episodes_learn_the_policys_tokens():
    from shardrl.models.tiny import train_tokenizer
    from shardrl.stages.sft import _batch, encode_episodes

    demo = CalcTask().demonstration(ITEM, random.Random(0), slip=False)
    assert demo.turns == (("calc(4*21)", "= 84"), ("answer: 84", ""))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer([demo.text()], tmp)
    (ids, mask), = encode_episodes(tok, [demo])
    n = len(ITEM.prompt) + 1  # BOS + one token per character
    assert len(ids) == n + 11 + 4 + 11
    assert mask == [0] * n + [1] * 11 + [0] * 4 + [1] * 11
    assert ids[n + 10] == tok.eos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[n + 11: n + 15]) == "= 84"
    _, _, labels = _batch([(ids, mask)], tok.pad_token_id)
    assert labels[0].tolist() == [t if m else -100 for t, m in zip(ids, mask, strict=True)]


def test_chat_observation_follows_the_policys_eos():
    class Tok:
        eos_token = "</s>"
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            text = "".join(f"<|{m['role']}|>{m['content']}</s>\n" for m in messages)
            return text + ("<|assistant|>" if add_generation_prompt else "")

    fmt = PromptFormat("chat")
    assert fmt.observation_text(Tok(), "= 84") == "\n<|user|>= 84</s>\n<|assistant|>"
    assert PromptFormat("raw").observation_text(Tok(), "= 84") == "= 84"


def test_guess_environment_and_its_demonstrations():
    env = Guess()
    item = GuessTask().make_item(10, 20, 13)
    assert env.reset(item) == "guess 10-20"
    assert (env.step("guess: 15").observation, env.step("guess: 12").observation) == \
        ("= lower", "= higher")
    assert env.step("guess: 13") == type(env.step("guess: 1"))("", 1.0, True)
    assert env.step("no idea").done
    # a bisecting demonstrator's episode replays in the environment to reward 1, with the
    # environment's own replies, in at most 5 guesses (a slip costs a turn, never the secret)
    task = GuessTask()
    demos = demonstrations(task, 40, seed=3, error_rate=0.3)
    for demo, item in zip(demos, task._distinct("train", 40, 3 + 7_919), strict=True):
        assert env.reset(item) == demo.prompt
        replies = [env.step(action) for action, _ in demo.turns]
        assert [r.observation for r in replies] == [o for _, o in demo.turns]
        assert [r.reward for r in replies] == [0.0] * (len(replies) - 1) + [1.0]
        assert len(demo.turns) <= 5


def test_calculator_demonstrations_and_slips():
    task = CalcTask()
    demos = demonstrations(task, 200, seed=0, error_rate=0.3)
    direct = 0
    for demo, item in zip(demos, task._distinct("train", 200, 7_919), strict=True):
        env = Calculator()
        assert env.reset(item) == demo.prompt
        replies = [env.step(action) for action, _ in demo.turns]
        assert [r.observation for r in replies] == [o for _, o in demo.turns]
        if len(demo.turns) == 1:  # the tool skipped: a guess one digit off, wrong
            direct += 1
            assert replies[0].reward == 0.0 and demo.turns[0][0] != f"answer: {item.answer}"
        else:
            assert [r.reward for r in replies] == [0.0, 1.0]
    assert 40 <= direct <= 80  # about 30% of 200


def test_config_asks_for_an_environment():
    from shardrl.config import ConfigError, RunConfig, load_config

    cfg = load_config("calculator")
    assert (cfg.task.environment, cfg.rollout.max_turns) == ("calculator", 3)
    assert RunConfig().rollout.max_turns == 1 and RunConfig().task.environment is None
    with pytest.raises((ConfigError, ValueError), match="set `task.environment`"):
        RunConfig.model_validate({"rollout": {"max_turns": 2}})
    with pytest.raises((ConfigError, ValueError), match="task.environment: guess"):
        RunConfig.model_validate({"task": {"source": {"kind": "builtin", "name": "guess"}}})
    # the overlong penalty counts one turn's limit against the whole episode: refused
    with pytest.raises(ConfigError, match="`reward.overlong` measures a response against"):
        load_config("calculator", ["reward.overlong={buffer_tokens: 4}"])


def test_the_splits_hold_enough_distinct_prompts():
    for task in (CalcTask(), GuessTask()):
        heldout, validation = task.heldout(256), task.validation(256)
        assert len({it.prompt for it in heldout}) == 256 == len({it.prompt for it in validation})
        assert not {it.prompt for it in heldout} & {it.prompt for it in validation}


def test_learner_gae_rewards_sit_on_the_last_policy_token_of_an_episode():
    from shardrl.config import RunConfig
    from shardrl.stages.update import gae_rewards

    # an episode cut after the environment's reply (its last 4 tokens are not the policy's),
    # and a single response: the sequence reward goes to the last token the policy generated
    table = _rollout_table(_two_episodes())
    mask = table.column("policy_mask").to_pylist()
    mask[0] = mask[0][:11] + [0] * 15  # as if turn 2 were the environment's
    table = table.set_column(table.column_names.index("policy_mask"), "policy_mask",
                             pa.array(mask, pa.list_(pa.int8())))
    table = table.append_column("reward_total", pa.array([2.0, -1.0], pa.float32()))
    batch = build_batch(table, pad_id=0)
    rewards = gae_rewards(RunConfig(), table, batch, torch.zeros_like(batch.response_mask), 0.0)
    assert rewards[0].nonzero().tolist() == [[10]] and rewards[0, 10] == 2.0
    assert rewards[1].nonzero().tolist() == [[10]] and rewards[1, 10] == -1.0


def test_the_learner_counts_only_the_policys_tokens_of_an_episode():
    from shardrl.stages.episodes import policy_tokens

    single = pa.table({"response_token_ids": pa.array([[5, 6, 7], [8]], pa.list_(pa.int32()))})
    assert policy_tokens(single) == 4
    # two turns of 2 policy tokens around a 3-token reply: 4 of the 7 tokens are the policy's
    episode = pa.table({
        "response_token_ids": pa.array([[5, 6, 9, 9, 9, 7, 2]], pa.list_(pa.int32())),
        "policy_mask": pa.array([[1, 1, 0, 0, 0, 1, 1]], pa.list_(pa.int8()))})
    assert policy_tokens(episode) == 4
    assert policy_tokens(episode.slice(0, 0)) == 0


def test_rollout_token_rate_counts_the_policys_tokens():
    from types import SimpleNamespace

    from shardrl.stages.rollout import _log_metrics

    table = _rollout_table(_two_episodes())  # responses of 26 and 11 tokens, 33 the policy's
    got = {}
    ctx = SimpleNamespace(metrics=SimpleNamespace(log=lambda version, values: got.update(values)))
    flow = SimpleNamespace(busy_fraction=lambda: 1.0, busy_s=2.0, generating_s=1.0,
                           sampling_cpu_s=1.0)
    _log_metrics(ctx, 3, 4, table, 0.5, flow)
    assert got["tokens_per_s"] == pytest.approx(33 / 0.5)  # the replies' 4 tokens left out
    assert got["response_length_mean"] == 18.5 and got["response_length_max"] == 26
    assert got["policy_token_frac"] == pytest.approx(33 / 37)
    assert got["samples"] == 2 and got["version_lag"] == 1
