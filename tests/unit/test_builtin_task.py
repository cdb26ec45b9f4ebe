"""The built-in addition task: splits, determinism, categories and the verifier."""

import itertools

import pytest

from shardrl.tasks.builtin import BuiltinTask, TaskItem, count_carries, split_of, verify


def test_make_item_by_hand():
    item = BuiltinTask().make_item(347, 85)
    # 7+5=12 carries, 4+8+1=13 carries, 3+0+1=4 does not -> 2 carries; 347+85=432
    assert (item.prompt, item.answer, item.category) == ("347+85=", "432", "carries_2")
    assert count_carries(95, 7) == 2  # 5+7=12, 9+0+1=10
    assert count_carries(123, 456) == 0
    assert count_carries(0, 0) == 0


def test_verify_on_hand_examples():
    assert verify("432", "432") == 1.0
    assert verify(" 432\n", "432") == 1.0  # surrounding whitespace is ignored
    assert verify("4320", "432") == 0.0
    assert verify("43", "432") == 0.0
    assert verify("", "432") == 0.0
    assert BuiltinTask().verify("17", "17") == 1.0


def test_heldout_is_fixed_distinct_and_a_prefix_of_larger_calls():
    task = BuiltinTask()
    small, large = task.heldout(50), task.heldout(300)
    assert small == large[:50] == BuiltinTask().heldout(50)
    assert len({it.prompt for it in large}) == 300
    assert all(isinstance(it, TaskItem) and split_of(it.prompt) == "heldout" for it in large)
    assert all(int(it.answer) == sum(map(int, it.prompt[:-1].split("+"))) for it in large)


def test_training_data_never_touches_heldout_or_validation():
    task = BuiltinTask()
    reserved = {it.prompt for it in task.heldout(2000)} | {it.prompt for it in task.validation(2000)}
    demos = task.demonstrations(2000, seed=0)
    stream = [it.prompt for it in itertools.islice(task.train_prompts(seed=0), 2000)]
    assert not reserved & {p for p, _ in demos}
    assert not reserved & set(stream)
    assert {split_of(p) for p, _ in demos} | {split_of(p) for p in stream} == {"train"}
    assert not {it.prompt for it in task.heldout(2000)} & {it.prompt for it in task.validation(2000)}


def test_seeded_data_is_deterministic_and_seed_dependent():
    task = BuiltinTask()
    assert task.demonstrations(100, seed=3) == task.demonstrations(100, seed=3)
    assert task.demonstrations(100, seed=3) != task.demonstrations(100, seed=4)
    assert len({p for p, _ in task.demonstrations(100, seed=3)}) == 100
    first = list(itertools.islice(task.train_prompts(seed=5), 20))
    assert first == list(itertools.islice(task.train_prompts(seed=5), 20))
    assert first != list(itertools.islice(task.train_prompts(seed=6), 20))


def test_operands_respect_max_digits_and_cover_each_digit_count():
    items = list(itertools.islice(BuiltinTask(max_digits=2).train_prompts(seed=0), 500))
    operands = [int(x) for it in items for x in it.prompt[:-1].split("+")]
    assert max(operands) <= 99
    assert {len(str(x)) for x in operands} == {1, 2}


def test_config_max_digits_reaches_the_task():
    from shardrl.config import ConfigError, validate
    from shardrl.tasks.source import make_task

    cfg = validate({"task": {"source": {"kind": "builtin", "name": "addition", "max_digits": 2,
                                        "heldout_size": 16}}}, "test")
    task = make_task(cfg)
    operands = [int(x) for item in task.train_items(0, 0, 300)
                for x in item.prompt.rstrip("=").split("+")]
    assert max(operands) <= 99 and min(operands) >= 0
    assert {len(str(x)) for x in operands} == {1, 2}
    assert validate({}, "test").task.source.max_digits == 3
    # 10,000 two-digit sums, about 1,000 held out: at most 500 can be asked for
    assert validate({"task": {"source": {"kind": "builtin", "name": "addition", "max_digits": 2,
                                         "heldout_size": 500}}}, "test")
    with pytest.raises(ConfigError, match=r"heldout_size` \(501\) exceeds half the held-out"):
        validate({"task": {"source": {"kind": "builtin", "name": "addition", "max_digits": 2,
                                      "heldout_size": 501}}}, "test")


def test_asking_for_more_prompts_than_a_split_holds_is_an_error_not_a_hang():
    """The guessing game's held-out split holds 828 distinct prompts: 829 used to be drawn
    for ever, in every stage that builds the task."""
    import time

    from shardrl.tasks.episodic import GuessTask

    assert len(GuessTask().heldout(828)) == 828
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"task 'guess': its heldout split holds about 828 "
                       r"distinct prompts, fewer than the 829 asked \(task.source.heldout_size\)"):
        GuessTask().heldout(829)
    assert time.monotonic() - started < 60
