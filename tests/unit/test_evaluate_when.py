"""When the evaluate stage evaluates: as versions are published (`eval.when: during`) or only
once the learner has finished (`after`); the same versions in the same order either way."""

from __future__ import annotations

import logging

import pytest

import shardrl.stages.engine as engine_module
import shardrl.stages.evaluate as evaluate
from shardrl.config import load_config
from shardrl.stages.policy import MANIFEST
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import Aborted, Done

FINISHED_AT_POLL = 4
"""The learner finishes (or the run is aborted) before the evaluate stage's fourth check."""


class Stage:
    """The parts of a `StageContext` the evaluate loop uses. Versions 0 to `final` are
    published from the start; at the `FINISHED_AT_POLL`-th check of `done` the learner has
    written DONE.json at `final`, or, with `abort`, another stage has aborted the run (at
    the `at`-th check instead, when given)."""

    def __init__(self, tmp_path, when: str, final: int = 6, abort: bool = False,
                 at: int = FINISHED_AT_POLL) -> None:
        self.cfg = load_config("demo", ["learner.total_steps=6", "eval.every=3",
                                        f"eval.when={when}", "eval.poll_interval_s=0.001"])
        self.store, self.keys = LocalStore(tmp_path), RunKeys("r")
        self.log, self.once, self.polls = logging.getLogger("test"), False, 0
        self.final, self.abort, self.at = final, abort, at
        for v in range(final + 1):
            self.store.put_json(self.keys.policy_file(v, MANIFEST), {"time": float(v)})

    def wait_for_run(self) -> None:
        pass

    def wait_for_policy(self, interval: float) -> None:
        pass

    def done(self) -> bool:
        self.polls += 1
        if self.polls == self.at:
            if self.abort:
                Aborted(stage="learn", reason="test").write(self.store, self.keys.aborted())
            else:
                Done(steps=self.final).write(self.store, self.keys.done())
        return self.polls >= self.at

    def latest_version(self) -> int:
        return self.final

    def aborted(self):
        return Aborted.read(self.store, self.keys.aborted(), optional=True)


def run(stage: Stage, monkeypatch) -> list[tuple[int, int]]:
    """(version, the check of `done` it followed) of each evaluation, in order."""
    evaluated: list[tuple[int, int]] = []
    monkeypatch.setattr(engine_module, "PolicyEngine", lambda ctx, version: object())
    monkeypatch.setattr(evaluate, "evaluate_version",
                        lambda ctx, engine, task, v: evaluated.append((v, ctx.polls)))
    assert evaluate.main(stage) == 0
    return evaluated


@pytest.mark.parametrize("when, first_poll", [("during", 1), ("after", FINISHED_AT_POLL)])
def test_versions_are_evaluated_as_eval_when_says(tmp_path, monkeypatch, when, first_poll):
    evaluated = run(Stage(tmp_path, when), monkeypatch)
    # no summary of v0 in the store: the stage owes it too, then every version it wants
    assert [v for v, _ in evaluated] == [0, 3, 6]
    assert [poll for _, poll in evaluated] == [first_poll, first_poll + 1, first_poll + 2]


def test_after_a_learner_that_stopped_early_its_last_version_is_evaluated(tmp_path, monkeypatch):
    evaluated = run(Stage(tmp_path, "after", final=4), monkeypatch)
    assert evaluated == [(0, FINISHED_AT_POLL), (3, FINISHED_AT_POLL + 1),
                         (4, FINISHED_AT_POLL + 2)]


def test_an_aborted_run_is_not_evaluated_after(tmp_path, monkeypatch):
    assert run(Stage(tmp_path, "after", abort=True), monkeypatch) == []


def test_an_aborted_run_stops_evaluating_during_with_versions_still_due(tmp_path, monkeypatch):
    """Versions 3 and 6 are published and due when the run is aborted: the stage stops at
    once. It used to evaluate every version due before it looked at the abort marker."""
    assert run(Stage(tmp_path, "during", abort=True, at=2), monkeypatch) == [(0, 1)]
