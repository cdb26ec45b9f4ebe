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

FINISHED_AT_POLL = 4
"""The learner writes DONE.json before the evaluate stage's fourth check."""


class Stage:
    """The parts of a `StageContext` the evaluate loop uses: versions 0-6 are published from
    the start and the learner finishes at the `FINISHED_AT_POLL`-th check of `done`."""

    def __init__(self, tmp_path, when: str) -> None:
        self.cfg = load_config("demo", ["learner.total_steps=6", "eval.every=3",
                                        f"eval.when={when}", "eval.poll_interval_s=0.001"])
        self.store, self.keys = LocalStore(tmp_path), RunKeys("r")
        self.log, self.once, self.polls = logging.getLogger("test"), False, 0
        for v in range(7):
            self.store.put_json(self.keys.policy_file(v, MANIFEST), {"time": float(v)})

    def wait_for_run(self) -> None:
        pass

    def wait_for_policy(self, interval: float) -> None:
        pass

    def done(self) -> bool:
        self.polls += 1
        return self.polls >= FINISHED_AT_POLL

    def latest_version(self) -> int:
        return 6

    def aborted(self):
        return None


@pytest.mark.parametrize("when, first_poll", [("during", 1), ("after", FINISHED_AT_POLL)])
def test_versions_are_evaluated_as_eval_when_says(tmp_path, monkeypatch, when, first_poll):
    stage = Stage(tmp_path, when)
    evaluated: list[tuple[int, int]] = []  # (version, the check of `done` it followed)
    monkeypatch.setattr(engine_module, "PolicyEngine", lambda ctx, version: object())
    monkeypatch.setattr(evaluate, "evaluate_version",
                        lambda ctx, engine, task, v: evaluated.append((v, ctx.polls)))
    assert evaluate.main(stage) == 0
    # no summary of v0 in the store: the stage owes it too, then every version it wants
    assert [v for v, _ in evaluated] == [0, 3, 6]
    assert [poll for _, poll in evaluated] == [first_poll, first_poll + 1, first_poll + 2]
