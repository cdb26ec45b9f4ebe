"""The built-in cipher task and the imperfect demonstrator."""

from shardrl.tasks.builtin import split_of
from shardrl.tasks.cipher import CipherTask, shift, with_slips


def test_shift_by_hand():
    assert shift("cafj") == "dbga"  # c->d, a->b, f->g, j wraps to a
    assert shift("abcdefghij") == "bcdefghija"


def test_items_splits_and_verifier():
    task = CipherTask()
    item = task.make_item("cafj")
    assert (item.prompt, item.answer, item.category) == ("cafj=", "dbga", "len_4")
    held = task.heldout(64)
    assert held == task.heldout(64) and held[:10] == task.heldout(10)  # fixed, prefix-stable
    assert all(split_of(it.prompt) == "heldout" for it in held)
    demos = task.demonstrations(100, seed=3)
    assert len({p for p, _ in demos}) == 100
    assert not {p for p, _ in demos} & {it.prompt for it in held}
    assert all(3 <= len(p) - 1 <= 6 and a == shift(p[:-1]) for p, a in demos)
    assert task.verify(" dbga\n", "dbga") == 1.0 and task.verify("dbgb", "dbga") == 0.0


def test_slips_change_one_letter_of_the_chosen_share():
    pairs = CipherTask().demonstrations(400, seed=0)
    noisy = with_slips(pairs, 0.3, seed=0)
    changed = [(a, b) for (_, a), (_, b) in zip(pairs, noisy, strict=True) if a != b]
    assert 0.22 < len(changed) / len(pairs) < 0.38  # about 30%
    for clean, slipped in changed:
        diffs = [i for i, (x, y) in enumerate(zip(clean, slipped, strict=True)) if x != y]
        assert len(diffs) == 1 and len(clean) == len(slipped)
    assert with_slips(pairs, 0.3, seed=0) == noisy  # deterministic
    assert with_slips(pairs, 0.0, seed=0) == pairs
