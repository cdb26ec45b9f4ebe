"""A real healthy run's metrics (a fixture) give no finding, at the end and at every step."""

from __future__ import annotations

import json
from pathlib import Path

from shardrl.config import RunConfig
from shardrl.doctor import Metrics, diagnose, unassessed

FIXTURE = Path(__file__).parents[1] / "fixtures" / "doctor_healthy_metrics.json"


def healthy_points() -> list[tuple[str, int, float]]:
    return [tuple(p) for p in json.loads(FIXTURE.read_text())["points"]]


def test_healthy_run_has_no_findings_and_every_rule_could_look():
    m = Metrics.from_points(healthy_points())
    # the run logged KL, clip fraction, entropy, rewards, lengths, filters and evaluations
    assert unassessed(m) == {}
    assert len(m.get("learn/kl_mean")) == 12 and len(m.get("evaluate/pass_at_1")) == 3
    assert diagnose(m, RunConfig()) == []


def test_live_checks_on_a_healthy_run_stay_quiet_at_every_step():
    points = healthy_points()
    for step in range(13):  # what the live doctor sees after each learner step
        m = Metrics.from_points(p for p in points if p[1] <= step)
        assert diagnose(m, RunConfig()) == [], step
