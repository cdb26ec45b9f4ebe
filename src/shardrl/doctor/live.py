"""The doctor inside the learner: every `learner.doctor_every` steps it reads the run's new
metric chunks, runs the rules, and reports each symptom once per run. It runs where the
learner's commit writes do (`stages.learn.offload`: the commit child process by default), so
its Python does not hold the interpreter the updates run on.

Reported findings are kept in `state/learn/doctor.json` (written by the learner only), so a
restarted learner does not repeat them and the runner can tag the MLflow run from them
(`finding_tags(saved_findings(store, keys))`).
"""

from __future__ import annotations

import logging

from ..config import RunConfig
from ..store import RunKeys, Store
from .findings import Finding, format_finding
from .rules import diagnose
from .series import ChunkReader

STATE_NAME = "doctor.json"


def state_key(keys: RunKeys) -> str:
    return keys.state("learn", STATE_NAME)


def saved_findings(store: Store, keys: RunKeys) -> list[Finding]:
    """The findings the live doctor reported so far, oldest first."""
    key = state_key(keys)
    if not store.exists(key):
        return []
    return [Finding.from_dict(d) for d in store.get_json(key)["findings"]]


class LiveDoctor:
    """`check(step)` returns (and logs) the findings not reported before in this run."""

    def __init__(self, cfg: RunConfig, store: Store, keys: RunKeys) -> None:
        self.cfg, self.store, self.keys = cfg, store, keys
        self.reader = ChunkReader(store, keys)
        self.saved = [f.to_dict() for f in saved_findings(store, keys)]
        self.reported = {d["code"] for d in self.saved}
        self.log = logging.getLogger("shardrl.doctor")

    def check(self, step: int) -> list[Finding]:
        """Diagnose the metrics written so far; `step` is the learner's current version.
        The doctor advises: a failure of its own (a store error, a defect) is logged and the
        check skipped, never raised into the learner's commit it runs beside."""
        try:
            return self._check(step)
        except Exception as e:  # noqa: BLE001 - advisory: nothing here may stop training
            self.log.warning("doctor check at step %d skipped: %s: %s", step,
                             type(e).__name__, e)
            return []

    def _check(self, step: int) -> list[Finding]:
        self.reader.poll()
        new = [f for f in diagnose(self.reader.metrics(), self.cfg)
               if f.code not in self.reported]
        for f in new:
            self.log.warning("doctor at step %d:\n%s", step, format_finding(f))
            self.reported.add(f.code)
            self.saved.append(f.to_dict() | {"reported_at": step})
        if new:
            self.store.put_json(state_key(self.keys), {"findings": self.saved})
        return new
