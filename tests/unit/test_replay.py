"""Replay's pieces: the recorded threads it sets, the bitwise comparison, the ledger fields."""

import torch

from shardrl.commands.replay_cmd import spans
from shardrl.stages.learn.replay import ReplayCores, first_difference, ledger_deltas
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import LearnerRestart, LedgerDelta, LedgerEntry, Progress


def test_replay_cores_set_the_recorded_threads_of_forward_and_backward():
    before = torch.get_num_threads()
    cores = ReplayCores(default=1)
    try:
        cores.use([3, 2])
        with cores.busy() as c:
            assert torch.get_num_threads() == 3
            assert c.adjust() == 2 and torch.get_num_threads() == 2
        cores.use([])  # a ledger written before threads were recorded: the configured count
        with cores.busy():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_first_difference_compares_bits_and_names_the_first_tensor():
    a = {"b": torch.tensor([0.0, 1.0, 2.0]), "a": torch.tensor([1.5, float("nan")])}
    same = {k: v.clone() for k, v in a.items()}
    assert first_difference(4, a, same) is None  # NaN equals the same NaN, bit for bit
    neg = dict(same, b=torch.tensor([-0.0, 1.0, 2.0]))
    d = first_difference(4, a, neg)  # -0.0 == 0.0 as numbers, not as bits
    assert (d.version, d.tensor, d.elements, d.max_abs_diff) == (4, "b", 1, 0.0)
    off = {"a": torch.tensor([1.25, float("nan")]), "b": torch.tensor([0.0, 1.5, 3.0])}
    d = first_difference(7, a, off)  # name order: "a" first
    assert (d.tensor, d.elements, d.max_abs_diff) == ("a", 1, 0.25)
    d = first_difference(7, a, {"a": a["a"]})
    assert (d.tensor, d.elements, d.max_abs_diff) == ("b", 3, None)
    d = first_difference(7, a, dict(a, a=a["a"].double()))
    assert (d.tensor, d.max_abs_diff) == ("a", None)


def test_ledger_delta_keeps_what_replay_needs_and_reads_older_deltas(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r")
    delta = LedgerDelta(version=3, stepped=True, beta=0.05, threads=[2, 1],
                        shards=[LedgerEntry(key="runs/r/ready/v000002/w00-000001.parquet",
                                            outcome="admitted", rows=8)],
                        restart=LearnerRestart(checkpoint=2))
    delta.write(store, keys.ledger(3))
    assert LedgerDelta.read(store, keys.ledger(3)) == delta
    store.put_json(keys.ledger(4), {"version": 3, "stepped": False, "shards": []})
    old = LedgerDelta.read(store, keys.ledger(4))
    assert (old.beta, old.threads, old.restart) == (None, [], None)


def test_spans():
    assert spans([1, 2, 3, 5, 7, 8]) == "v1-v3, v5, v7-v8"
    assert spans([]) == ""


def test_a_run_recorded_before_prompt_sharing_replays_on_whole_rows():
    from shardrl.commands.replay_cmd import as_recorded

    old = {"seed": 3, "learner": {"lr": 0.001}}
    assert as_recorded(old) == {"seed": 3, "learner": {"lr": 0.001, "share_prompts": False}}
    assert old == {"seed": 3, "learner": {"lr": 0.001}}  # the recorded dict is left as it is
    new = {"learner": {"lr": 0.001, "share_prompts": True}}
    assert as_recorded(new) == new


def test_replay_follows_the_committed_deltas_only(tmp_path):
    """A learner stopped between a commit's ledger delta and its progress.json left a delta
    whose step was never committed (its restart takes the step again): replay skips it."""
    store, keys = LocalStore(tmp_path), RunKeys("r")
    for n in (1, 2, 3, 10):
        LedgerDelta(version=n - 1, stepped=True).write(store, keys.ledger(n))
    Progress(version=3, commits=3).write(store, keys.progress())
    assert [d.version for d in ledger_deltas(store, keys)] == [0, 1, 2]
    Progress(version=10, commits=10).write(store, keys.progress())
    assert [d.version for d in ledger_deltas(store, keys)] == [0, 1, 2, 9]
    assert ledger_deltas(store, RunKeys("none")) == []  # nothing committed yet
