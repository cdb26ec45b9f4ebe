"""`eval_setup`: what an evaluation's figures depend on besides the policy, as one hash that
promote compares before it moves the champion."""

from shardrl.config import load_config
from shardrl.config.data import OverlongPenalty
from shardrl.stages.evaluate import eval_setup
from shardrl.tasks.builtin import TaskItem

ITEMS = [TaskItem("p1", "3+4=", "7", "add"), TaskItem("p2", "9-2=", "7", "sub")]


def _cfg(**sections):
    cfg = load_config("demo")
    return cfg.model_copy(update={name: getattr(cfg, name).model_copy(update=values)
                                  for name, values in sections.items()})


def test_the_same_items_and_settings_give_the_same_setup():
    assert eval_setup(_cfg(), ITEMS) == eval_setup(_cfg(), list(ITEMS))
    assert len(eval_setup(_cfg(), ITEMS)) == 16
    # what does not change the measurement: how often and when it runs, the run's seed
    assert eval_setup(_cfg(eval={"every": 3, "when": "after", "threads": 2}), ITEMS) == \
        eval_setup(_cfg(), ITEMS)
    assert eval_setup(_cfg().model_copy(update={"seed": 7}), ITEMS) == eval_setup(_cfg(), ITEMS)


def test_another_held_out_set_sampling_or_scoring_gives_another_setup():
    base = eval_setup(_cfg(), ITEMS)
    others = [
        eval_setup(_cfg(), ITEMS[:1]),
        eval_setup(_cfg(), [ITEMS[0], TaskItem("p2", "9-2=", "8", "sub")]),  # another answer
        eval_setup(_cfg(eval={"temperature": 0.0}), ITEMS),
        eval_setup(_cfg(eval={"samples_per_prompt": 4}), ITEMS),
        eval_setup(_cfg(eval={"max_new_tokens": 3}), ITEMS),
        eval_setup(_cfg(task={"prompt_format": "chat"}), ITEMS),
        eval_setup(_cfg(task={"source": _cfg().task.source.model_copy(
            update={"name": "addition"})}), ITEMS),  # another task's verifier
    ]
    assert base not in others and len(set(others)) == len(others)


def test_the_training_reward_is_not_part_of_the_setup():
    """An evaluation scores with the task's verifier, not the training reward's shaping, a
    reward model or an overlong penalty: changing those compares as before."""
    cfg = _cfg()
    shaped = _cfg(reward={"overlong": OverlongPenalty(buffer_tokens=2, penalty=0.5)})
    assert shaped.reward != cfg.reward
    assert eval_setup(shaped, ITEMS) == eval_setup(cfg, ITEMS)
    # in an environment the sandbox's limits shape the episodes: there they count
    calc = load_config("calculator")
    tighter = calc.model_copy(update={"reward": calc.reward.model_copy(update={
        "sandbox": calc.reward.sandbox.model_copy(update={"wall_seconds": 0.5})})})
    assert eval_setup(tighter, ITEMS) != eval_setup(calc, ITEMS)
