"""A run with nothing to learn from stops itself with a diagnosis instead of spinning; a
run whose policy gets every sample right finishes early as converged.

An untrained model on the cipher task gets every sample of every group wrong, so
zero-variance filtering keeps no group and the policy can never change. The learner commits
those groups as filtered; after `learner.max_batches_without_signal` batches' worth of them
it writes ABORTED.json with the reason, every stage stops, and the runner exits 1 at once
(no restarts: a new learner would meet the same data). Until then the rollout worker's
backlog of groups, kept or not, stays bounded, and every sample is accounted for.
"""

from __future__ import annotations

from shardrl.orchestrate.accounting import account
from shardrl.stages import EXIT_RUN_ABORTED
from shardrl.stages.evaluate import summaries
from shardrl.stages.staleness import backlog_cap, group_cap
from shardrl.store import LocalStore, RunKeys, shards_by_name

from .test_faults import SETTINGS, finish, run_args, start_runner, write_config

LIMIT = 3
"""learner.max_batches_without_signal in this run (batch_prompts 2: 6 groups)."""


def test_a_run_without_signal_aborts_with_the_diagnosis_and_a_bounded_backlog(tmp_path):
    config = write_config(tmp_path)
    proc, out = start_runner(tmp_path, run_args(
        config, str(tmp_path / "store"), "barren", "learner.total_steps=1000",
        "model.sft.enabled=false", "algo.filters.zero_variance=true", "rollout.workers=1",
        f"learner.max_batches_without_signal={LIMIT}", "eval.every=1000"), "barren")
    text = finish(proc, out, timeout=300)
    assert proc.returncode == 1, text[-3000:]
    assert "run aborted: learn stopped the run" in text and "nothing to learn from" in text
    assert "restarting" not in text  # the learner is not restarted into the same data

    store, keys = LocalStore(tmp_path / "store"), RunKeys("barren")
    marker = store.get_json(keys.aborted())
    assert marker["stage"] == "learn" and marker["exit_code"] == EXIT_RUN_ABORTED
    assert "mean reward 0.000" in marker["reason"]
    assert "learner.max_batches_without_signal = 3" in marker["reason"]
    assert not store.exists(keys.done())

    progress = store.get_json(keys.progress())
    assert progress["version"] == 0  # no update was ever applied
    # the commits that led there: at least LIMIT batches of 2 groups, all filtered
    assert progress["counts"]["consumed"] == 0
    assert progress["groups_by_worker"]["0"] >= LIMIT * 2
    assert progress["kept_groups_by_worker"].get("0", 0) == 0
    # the worker never had more than its bound of groups waiting (cap of kept groups
    # 2 x (1 + 1) = 4, so 32 groups), plus the batch it had started: 8 shards of 2 groups
    written = len(shards_by_name(store, keys, ("rollouts", "ready")))
    assert written > 0
    bound = group_cap(backlog_cap(2, min(1, 2)))
    assert bound == 32
    assert 2 * written <= progress["groups_by_worker"]["0"] + bound + 2 * 8
    acc = account(store, keys)
    assert acc.balanced, acc.line()
    assert acc.consumed == 0 and acc.filtered > 0


def test_a_run_whose_every_sample_is_correct_finishes_as_converged(tmp_path):
    """A verifier that accepts every response: every group's rewards are equal, so nothing is
    kept, but every sample was right. After the barren limit the learner writes DONE.json with
    `converged` at the version it reached (0: it never had a group to learn from), evaluate
    takes that version as the last, promote registers it and the runner exits 0."""
    (tmp_path / "always_right.py").write_text(
        "def verify(response: str, answer: str) -> float:\n    return 1.0\n")
    config = write_config(tmp_path, f"tracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n"
                          "reward: {verifiers: [{name: 'always_right:verify'}]}\n")
    settings = ("learner.total_steps=1000", "algo.filters.zero_variance=true",
                "rollout.workers=1", f"learner.max_batches_without_signal={LIMIT}",
                "eval.every=1000")
    proc, out = start_runner(tmp_path, run_args(config, str(tmp_path / "store"), "solved",
                                                *settings), "solved",
                             env={"PYTHONPATH": str(tmp_path)})
    text = finish(proc, out, timeout=300)
    assert proc.returncode == 0, text[-3000:]
    assert "learner steps     0 of 1000: converged" in text
    assert "registered model  tiny-e2e v1 (policy v0, pass_at_1 " in text
    assert f"MLflow            sqlite:///{tmp_path}/mlflow.db" in text

    store, keys = LocalStore(tmp_path / "store"), RunKeys("solved")
    assert not store.exists(keys.aborted())
    done = store.get_json(keys.done())
    assert done["converged"] is True and done["steps"] == 0
    assert done["counts"]["consumed"] == 0 and done["counts"]["filtered"] >= LIMIT * 2 * 4
    # the last version owed is the one the learner finished at: evaluated, and promoted
    assert sorted(summaries(store, keys, read=False)) == [0]
    promoted = store.get_json(keys.state("promote", "result.json"))
    assert promoted["version"] == 0
    acc = account(store, keys)
    assert acc.balanced, acc.line()

    # a learner stopped between DONE.json and its exit is restarted: it must end at once. It
    # used to go on at version 0 of 1000: commit what shards were left, write DONE.json again,
    # or, with none left, wait for shards that no worker (they stop on DONE.json) would write
    def learner_again(name: str) -> str:
        """The learn stage alone, restarted on the finished run; its output."""
        proc, out = start_runner(tmp_path, [
            "stage", "learn", "--config", str(config), "--run-id", "solved", "--store",
            str(tmp_path / "store"), *(x for s in (*SETTINGS, *settings) for x in ("--set", s))],
            name, env={"PYTHONPATH": str(tmp_path)})
        text = finish(proc, out, timeout=120)
        assert proc.returncode == 0, text[-3000:]
        return text

    before = store.get_bytes(keys.done())
    assert "the run is done" in learner_again("relearn")
    assert store.get_bytes(keys.done()) == before

    # one stopped after the commit that converged, before DONE.json: the commit carries the
    # count of groups with nothing kept, so its restart finishes the run at that version. It
    # used to count from nothing again and wait for shards no worker would write
    progress = store.get_json(keys.progress())
    assert progress["no_signal"]["groups"] >= LIMIT * 2
    assert progress["no_signal"]["correct"] == progress["no_signal"]["rows"]
    store.delete(keys.done())
    assert "converged at version 0 of 1000" in learner_again("unfinished")
    done = store.get_json(keys.done())
    assert done["converged"] is True and done["steps"] == 0
    assert store.get_json(keys.progress()) == progress  # no commit after the one before
