"""The runner's metric forwarding: one point per metric and step, sent once settled, each
step once across restarts, and the same series the doctor reads from the store."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest

from shardrl.config import RunConfig
from shardrl.doctor.series import ChunkReader
from shardrl.orchestrate.forward import Forwarder, SendFailed, metric_writers, settle_lags
from shardrl.store import LocalStore, RunKeys, write_shard
from shardrl.store.schemas import METRICS

KEYS = RunKeys("r1")
WRITERS = {"rollout": 2, "learn": 1}
_clock = itertools.count(1_712_000_000_000_000)


def log(store, stage: str, worker: int, points: list[tuple[str, int, float]]) -> str:
    """A metrics chunk of `stage`'s worker holding `points` (name, step, value)."""
    key = KEYS.metrics_chunk(stage, worker, next(_clock))
    names, steps, values = zip(*points, strict=True)
    table = pa.table({"stage": [stage] * len(points), "name": list(names), "step": list(steps),
                      "value": list(values), "time": [float(s) for s in steps]})
    write_shard(store, key, table, METRICS)
    return key


class Sent:
    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int, float]]] = []

    def __call__(self, points) -> None:
        self.batches.append([(n, s, v) for n, s, v, _ in points])

    def all(self) -> list[tuple[str, int, float]]:
        return [p for b in self.batches for p in b]


def forwarder(store, sent: Sent) -> Forwarder:
    return Forwarder(store, KEYS, WRITERS, sent)


def store_series(store) -> set[tuple[str, int, float]]:
    """What the doctor reads from the store: one value per (name, step)."""
    reader = ChunkReader(store, KEYS)
    reader.poll()
    return set(reader.metrics().to_points())


def test_a_step_is_sent_once_every_writer_of_its_stage_has_moved_past_it(tmp_path):
    store, sent = LocalStore(tmp_path), Sent()
    f = forwarder(store, sent)
    log(store, "rollout", 0, [("rollout/x", 1, 1.0), ("rollout/x", 1, 3.0),
                              ("rollout/len_max", 1, 4.0), ("rollout/len_max", 1, 7.0),
                              ("rollout/x", 2, 5.0)])
    log(store, "rollout", 1, [("rollout/x", 1, 2.0)])
    assert f.forward() == 0  # worker 1 may still log step 1
    log(store, "rollout", 1, [("rollout/x", 2, 8.0)])
    assert f.forward() == 2
    # step 1: the mean of 1, 3 and 2; the largest of the maxima 4 and 7
    assert sent.batches == [[("rollout/len_max", 1, 7.0), ("rollout/x", 1, 2.0)]]
    assert f.forward(final=True) == 1
    assert sent.batches[-1] == [("rollout/x", 2, 6.5)]  # (5 + 8) / 2
    assert set(sent.all()) == store_series(store) and len(sent.all()) == 3


def test_a_stage_waits_for_all_its_writers_and_a_one_shot_stage_does_not(tmp_path):
    store, sent = LocalStore(tmp_path), Sent()
    f = forwarder(store, sent)
    log(store, "snapshot", 0, [("snapshot/sft_loss", 0, 0.5)])
    log(store, "rollout", 0, [("rollout/x", 1, 1.0), ("rollout/x", 5, 1.0)])
    log(store, "learn", 0, [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)])
    f.forward()
    # rollout: one of its two workers has logged; learn: step 2 may still get points
    assert sorted(sent.all()) == [("learn/loss", 1, 0.3), ("snapshot/sft_loss", 0, 0.5)]


def test_a_restarted_forwarder_sends_each_step_once_and_loses_none(tmp_path):
    store, sent = LocalStore(tmp_path), Sent()
    first = forwarder(store, sent)
    log(store, "rollout", 0, [("rollout/x", 1, 1.0), ("rollout/x", 2, 2.0)])
    log(store, "rollout", 1, [("rollout/x", 1, 3.0), ("rollout/x", 2, 4.0),
                              ("rollout/x", 3, 9.0)])
    log(store, "learn", 0, [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)])
    first.forward()
    assert sorted(sent.all()) == [("learn/loss", 1, 0.3), ("rollout/x", 1, 2.0)]
    # the runner is killed: steps 2 (rollout, learn) and 3 (rollout) were read, not sent
    second = forwarder(store, sent)
    log(store, "rollout", 0, [("rollout/x", 2, 6.0), ("rollout/x", 3, 1.0)])
    log(store, "learn", 0, [("learn/loss", 3, 0.1)])
    second.forward()
    second.forward(final=True)
    # rollout step 2: (2 + 4 + 6) / 3 with the points read by the first forwarder, step 3:
    # (9 + 1) / 2; nothing sent twice
    assert sorted(sent.all()) == [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2),
                                  ("learn/loss", 3, 0.1), ("rollout/x", 1, 2.0),
                                  ("rollout/x", 2, 4.0), ("rollout/x", 3, 5.0)]
    assert set(sent.all()) == store_series(store)
    third = forwarder(store, sent)  # after the end: nothing left to send
    assert third.forward(final=True) == 0


def test_a_late_point_for_a_sent_step_is_sent_on_its_own(tmp_path):
    store, sent = LocalStore(tmp_path), Sent()
    f = forwarder(store, sent)
    log(store, "learn", 0, [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)])
    f.forward()
    log(store, "learn", 0, [("learn/loss", 1, 0.5)])  # a writer whose steps went back
    f.forward(final=True)
    assert sent.all() == [("learn/loss", 1, 0.3), ("learn/loss", 1, 0.5), ("learn/loss", 2, 0.2)]


def test_the_writers_of_inline_stages_are_the_rollout_workers():
    inline = RunConfig.model_validate({"rollout": {"workers": 3, "postprocess": "inline"}})
    assert metric_writers(inline) == {"rollout": 3, "score": 3, "prepare": 3, "learn": 1,
                                      "evaluate": 1}
    apart = RunConfig.model_validate({"rollout": {"workers": 3, "postprocess": "stages"}})
    assert metric_writers(apart)["score"] == 1 and metric_writers(apart)["prepare"] == 1


def test_a_scoring_stage_of_its_own_settles_its_steps_the_staleness_bound_later(tmp_path):
    """Score, as a stage of its own, logs each shard at its generating version as shards
    come: worker 0's v5 shard after worker 1's v6 one. Settled at its writer's newest step,
    v5 went to MLflow twice (a partial mean, then the late shard alone), unlike the store."""
    store, sent = LocalStore(tmp_path), Sent()
    apart = RunConfig.model_validate({"rollout": {"workers": 2, "postprocess": "stages"},
                                      "learner": {"max_staleness": 2}})
    assert settle_lags(apart) == {"score": 2, "prepare": 2}
    assert settle_lags(RunConfig.model_validate({"rollout": {"postprocess": "inline"}})) == {}
    huge = {"rollout": {"postprocess": "stages"}, "learner": {"max_staleness": 1000}}
    assert settle_lags(RunConfig.model_validate(huge)) == {"score": 32, "prepare": 32}
    f = Forwarder(store, KEYS, {"score": 1}, sent, lags=settle_lags(apart))
    log(store, "score", 0, [("score/reward", 5, 0.6), ("score/reward", 6, 0.7)])
    assert f.forward() == 0  # v5 may still come: a shard up to 2 versions older than v6
    log(store, "score", 0, [("score/reward", 5, 0.2), ("score/reward", 8, 0.9)])
    f.forward()
    f.forward(final=True)
    assert sent.all() == [("score/reward", 5, 0.4), ("score/reward", 6, 0.7),
                          ("score/reward", 8, 0.9)]
    assert set(sent.all()) == store_series(store)  # the doctor's series, from either side


def test_a_chunk_that_does_not_decode_is_passed_over_not_a_crash(tmp_path, caplog):
    """A truncated or foreign file among the chunks: the doctor skips it with a warning, and
    so does the forwarder (before, it raised in the runner at every resume, and in the
    Kubeflow monitor at every retry)."""
    store, sent = LocalStore(tmp_path), Sent()
    log(store, "learn", 0, [("learn/loss", 1, 0.5)])
    bad = KEYS.metrics_chunk("learn", 0, next(_clock))
    store.put_bytes(bad, b"PAR1 not really")
    log(store, "learn", 0, [("learn/loss", 2, 0.25)])
    f = forwarder(store, sent)
    assert f.forward(final=True) == 2
    assert sorted(sent.all()) == [("learn/loss", 1, 0.5), ("learn/loss", 2, 0.25)]
    assert any("does not decode" in r.getMessage() and bad in r.getMessage()
               for r in caplog.records)
    again = Sent()  # a restarted forwarder moved past it: nothing sent twice, nothing raised
    assert forwarder(store, again).forward(final=True) == 0 and again.all() == []


def test_points_whose_sending_failed_go_with_the_next_forward(tmp_path):
    """MLflow down: the points stay (in memory, and the saved place does not move past them)
    and are sent once it answers; a forwarder started over sends them too."""
    store, sent = LocalStore(tmp_path), Sent()
    down = True

    def send(points):
        if down:
            raise ConnectionError("MLflow is down")
        sent(points)

    f = Forwarder(store, KEYS, {"learn": 1}, send)
    log(store, "learn", 0, [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)])
    with pytest.raises(SendFailed, match="ConnectionError: MLflow is down"):
        f.forward()
    again = Forwarder(store, KEYS, {"learn": 1}, sent)  # a runner started over meanwhile
    again.forward(final=True)
    assert sent.all() == [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)]
    sent.batches.clear()
    down = False
    log(store, "learn", 0, [("learn/loss", 3, 0.1)])
    f.forward()
    assert sent.all() == [("learn/loss", 1, 0.3), ("learn/loss", 2, 0.2)]


def test_a_tick_does_not_wait_for_mlflow_nor_stop_the_run(monkeypatch, capsys):
    """The runner's loop restarts crashed stages and answers Ctrl-C: a forward that fails
    warns once and is tried again later, with MLflow's requests kept short meanwhile."""
    import os

    from shardrl.orchestrate import monitor as monitor_module
    from shardrl.orchestrate.monitor import BRIEF, Monitor

    seen = []

    class Failing:
        unsent = []

        def forward(self, final=False):
            seen.append(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES"))
            try:
                raise ConnectionError("http://u:secret@mlflow:5000 refused")
            except ConnectionError as exc:
                raise SendFailed(str(exc)) from exc

    m = Monitor.__new__(Monitor)
    m.mlflow, m.forwarder, m.forward_after, m.forward_failing = "run", Failing(), 0.0, False
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    m._forward(patient=False)
    m._forward(patient=False)  # within RETRY_S: not tried
    assert seen == [BRIEF["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]]
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the stages forked later
    monkeypatch.setattr(monitor_module, "RETRY_S", 0.0)
    m.forward_after = 0.0
    m._forward(final=True)  # the summary's: patient, MLflow's own retries
    assert seen[-1] is None
    err = capsys.readouterr().err
    assert err.count("MLflow did not take the run's metrics") == 1 and "secret" not in err
    m.forwarder = type("Up", (), {"forward": lambda self, final=False: 0})()
    m._forward()
    assert "MLflow takes the run's metrics again" in capsys.readouterr().err

    # points MLflow refuses (a bad value) are not sent again and again, blocking the rest
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    class Refusing:
        unsent = [("learn/loss", 1, float("nan"), 0.0)]

        def forward(self, final=False):
            try:
                raise MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)
            except MlflowException as exc:
                raise SendFailed(str(exc)) from exc

    m.forwarder = Refusing()
    m._forward()
    assert m.forwarder.unsent == []
    assert "MLflow refused a batch of the run's metric points" in capsys.readouterr().err
    assert not m.forward_failing  # it answers: nothing to try again, no outage to report
    from shardrl.tracking.mlflow_run import metric_name

    assert metric_name("evaluate/pass_at_1/Counting & Probability") == \
        "evaluate/pass_at_1/Counting _ Probability"
    # MLflow's own check takes every name it gives, and it leaves good names as they are
    from mlflow.utils.validation import _validate_metric_name

    long = "evaluate/pass_at_1/" + "x" * 300
    for raw, expected in [("evaluate/pass_at_1/Geometry/", "evaluate/pass_at_1/Geometry"),
                          ("evaluate/pass_at_1/..", "evaluate/pass_at_1/__"),
                          ("/learn//loss/./x", "learn/loss/x"), ("", "_"), ("/", "_"),
                          ("learn/loss", "learn/loss"), ("a/.../b.c", "a/.../b.c"),
                          (long, None), (long + "y", None)]:
        got = metric_name(raw)
        _validate_metric_name(got)
        assert expected is None or got == expected, (raw, got)
    assert len(metric_name(long)) == 250 and metric_name(long) != metric_name(long + "y")
    # anything else than MLflow failing is the run's own error, not hidden
    m.forwarder = type("Broken", (), {"forward": lambda self, final=False: 1 / 0})()
    with pytest.raises(ZeroDivisionError):
        m._forward()
