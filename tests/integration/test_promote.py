"""Promotion: model versions in the MLflow registry, aliases, and the champion rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = """\
extends: demo
model:
  source: {kind: tiny, hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32}
  sft: {enabled: false}
task:
  source: {kind: builtin, heldout_size: 16}
promote: {model_name: promo-test, margin: 0.02}
"""


def _stage(name: str, cfg: Path, store: Path, run_id: str, cwd: Path,
           env: dict[str, str] | None = None, status: int = 0) -> str:
    """Run stage `name`, which must exit with `status`; its output. MLflow at the config's
    `tracking.uri` unless `env` says otherwise (an MLFLOW_TRACKING_URI left in this process's
    environment by an in-process run of another test's stages would win over the config)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    res = subprocess.run([sys.executable, "-m", "shardrl.cli", "stage", name, "--config", str(cfg),
                          "--run-id", run_id, "--store", str(store)], cwd=cwd,
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == status, res.stderr[-3000:]
    return res.stdout + res.stderr


def _fake_evals(store: Path, run_id: str, values: dict[int, float],
                setup: str | None = None, se: float | None = None) -> None:
    """Evaluation summaries of `values` (version: pass@1, with standard error `se` if given),
    measured in `setup` if given, and the learner's DONE.json."""
    (store / "runs" / run_id / "DONE.json").write_text(json.dumps(
        {"steps": max(values), "counts": {}, "time": 0.0, "staleness": {}, "converged": False}))
    d = store / "runs" / run_id / "eval"
    d.mkdir(parents=True, exist_ok=True)
    policy = store / "runs" / run_id / "policy"
    for version, value in values.items():
        if version and not (policy / f"v{version:06d}").exists():  # same weights as v0
            shutil.copytree(policy / "v000000", policy / f"v{version:06d}")
        (d / f"v{version:06d}.json").write_text(json.dumps(
            {"pass_at_1": value, "mean_reward": value, "mean_length": 3.0, "version": version,
             "seconds": 1.5, "published": 1.7e9, "evaluated": 1.7e9 + 9, "temperature": 1.0,
             **({"setup": setup} if setup else {}),
             **({"pass_at_1_se": se} if se is not None else {})}))


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("promote")
    cfg = tmp / "c.yaml"
    cfg.write_text(CONFIG + f"tracking: {{uri: 'sqlite:///{tmp}/mlflow.db'}}\n")
    store = tmp / "store"
    _stage("snapshot", cfg, store, "base", tmp)
    return tmp, cfg, store


@pytest.fixture(autouse=True)
def _no_tracking_uri_in_the_environment(monkeypatch):
    """The config's `tracking.uri` names each test's registry: an MLFLOW_TRACKING_URI in this
    process's environment would win over it in the stage run here (`_promote_here`). The
    root conftest puts back what the stage sets (`mlflow_uri_kept`)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _promote_here(cfg: Path, store: Path, run_id: str) -> dict:
    """The promote stage's `main` on run `run_id`, in this process; its result. A process per
    call spent most of its ten seconds importing: the stage as a process of its own, with its
    exit statuses, is tested below (a retry, an unfinished run, a real MLflow server)."""
    from shardrl.config import load_config
    from shardrl.stages import promote
    from shardrl.stages.context import StageContext
    from shardrl.store import LocalStore

    ctx = StageContext(stage="promote", cfg=load_config(str(cfg)), run_id=run_id,
                       store=LocalStore(store))
    assert promote.main(ctx) == 0
    return json.loads((store / "runs" / run_id / "state" / "promote" / "result.json").read_text())


def _promote(registry, run_id: str, evals: dict[int, float], cfg: Path | None = None,
             setup: str | None = None) -> dict:
    tmp, base_cfg, store = registry
    shutil.copytree(store / "runs" / "base", store / "runs" / run_id)
    _fake_evals(store, run_id, evals, setup)
    return _promote_here(cfg or base_cfg, store, run_id)


def _aliases(tmp: Path) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db", registry_uri=f"sqlite:///{tmp}/mlflow.db")
    return {a: str(c.get_model_version_by_alias("promo-test", a).version)
            for a in ("champion", "challenger", "previous-champion")
            if a in c.get_registered_model("promo-test").aliases}


def test_champion_moves_only_when_beaten_by_the_margin(registry):
    tmp = registry[0]
    first = _promote(registry, "run-a", {0: 0.10, 5: 0.50, 10: 0.40})
    assert first["version"] == 5 and first["value"] == 0.50  # best, not last
    assert first["champion"] and _aliases(tmp) == {"champion": "1", "challenger": "1"}

    worse = _promote(registry, "run-b", {0: 0.10, 5: 0.51})  # +0.01 < margin 0.02
    assert not worse["champion"]
    assert _aliases(tmp) == {"champion": "1", "challenger": "2"}

    better = _promote(registry, "run-c", {0: 0.10, 5: 0.60})
    assert better["champion"]
    assert _aliases(tmp) == {"champion": "3", "challenger": "3", "previous-champion": "1"}


def test_a_champion_without_the_metric_tag_stays_champion(registry):
    """A champion set by hand (or promoted on another metric) has nothing to compare with:
    it used to be replaced by any challenger; now it stays, and the result says why."""
    tmp, cfg, _ = registry
    untagged = tmp / "untagged.yaml"
    untagged.write_text(f"extends: {cfg}\npromote: {{model_name: promo-untagged}}\n")
    c = _client(tmp)
    c.create_registered_model("promo-untagged")
    chosen = c.create_model_version("promo-untagged", source=str(tmp / "by-hand"))
    c.set_registered_model_alias("promo-untagged", "champion", chosen.version)
    result = _promote(registry, "run-u", {0: 0.10, 5: 0.90}, untagged)
    assert result["champion"] is False
    assert f"version {chosen.version} has no numeric eval.pass_at_1 tag" in result["champion_kept"]
    assert str(c.get_model_version_by_alias("promo-untagged", "champion").version) == \
        str(chosen.version)
    assert str(c.get_model_version_by_alias("promo-untagged", "challenger").version) == \
        str(result["model_version"])
    # a tag that is not a number compares with nothing either (it used to fail the promote)
    c.set_model_version_tag("promo-untagged", chosen.version, "eval.pass_at_1", "n/a")
    again = _promote(registry, "run-u2", {0: 0.10, 5: 0.95}, untagged)
    assert again["champion"] is False and "no numeric" in again["champion_kept"]
    assert str(c.get_model_version_by_alias("promo-untagged", "champion").version) == \
        str(chosen.version)
    # nor does a NaN: it used to keep the champion with no word of why (metric > nan is false)
    c.set_model_version_tag("promo-untagged", chosen.version, "eval.pass_at_1", "nan")
    third = _promote(registry, "run-u3", {0: 0.10, 5: 0.97}, untagged)
    assert third["champion"] is False and "no numeric" in third["champion_kept"]


def test_a_champion_measured_another_way_stays_champion(registry):
    """pass@1 on another task, held-out set or sampling does not compare: a challenger with a
    higher figure measured otherwise does not take the champion's place."""
    tmp, cfg, _ = registry
    named = tmp / "setup.yaml"
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-setup}}\n")
    first = _promote(registry, "run-s1", {0: 0.1, 5: 0.5}, named, setup="a" * 16)
    assert first["champion"]
    other = _promote(registry, "run-s2", {0: 0.1, 5: 0.9}, named, setup="b" * 16)
    assert other["champion"] is False
    assert other["champion_kept"].startswith(
        f"champion promo-setup version {first['model_version']} was evaluated on other "
        f"held-out items or with other sampling or scoring (shardrl.eval_setup {'a' * 16}, "
        f"this run's {'b' * 16})")
    c = _client(tmp)
    assert str(c.get_model_version_by_alias("promo-setup", "champion").version) == \
        str(first["model_version"])
    assert c.get_model_version("promo-setup", other["model_version"]).tags[
        "shardrl.eval_setup"] == "b" * 16
    same = _promote(registry, "run-s3", {0: 0.1, 5: 0.6}, named, setup="a" * 16)
    assert same["champion"] and "champion_kept" not in same
    # a champion registered before setups were recorded compares on its metric alone
    c.delete_model_version_tag("promo-setup", same["model_version"], "shardrl.eval_setup")
    later = _promote(registry, "run-s4", {0: 0.1, 5: 0.7}, named, setup="b" * 16)
    assert later["champion"]


def test_the_chosen_version_is_registered_and_compared_on_its_confirming_evaluation(registry):
    """The best of several evaluations is biased upward (the winner's curse): evaluate measures
    the chosen version again on fresh samples, and that figure is what is registered and
    compared. A confirmation of another version, or measured another way, is not used."""
    tmp, cfg, store = registry
    named = tmp / "confirm.yaml"
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-confirm, margin: 0.0}}\n")

    def confirmed(run_id: str, version: int, value: float, setup: str) -> None:
        folder = store / "runs" / run_id / "state" / "evaluate"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "confirm.json").write_text(json.dumps(
            {"pass_at_1": value, "mean_reward": value, "mean_length": 3.0, "version": version,
             "seconds": 1.0, "published": 1.7e9, "evaluated": 1.7e9, "temperature": 1.0,
             "seed": 12_346, "setup": setup}))

    def promote(run_id: str, evals: dict, confirm: tuple | None) -> dict:
        shutil.copytree(store / "runs" / "base", store / "runs" / run_id)
        _fake_evals(store, run_id, evals, "s" * 16)
        if confirm:
            confirmed(run_id, *confirm)
        return _promote_here(named, store, run_id)

    first = promote("run-k1", {0: 0.1, 5: 0.80, 10: 0.70}, (5, 0.74, "s" * 16))
    assert (first["version"], first["value"], first["selected_value"]) == (5, 0.74, 0.80)
    c = _client(tmp)
    assert float(c.get_model_version("promo-confirm", first["model_version"])
                 .tags["eval.pass_at_1"]) == 0.74
    # 0.78 when chosen beats the champion's 0.80 when chosen, not its confirmed 0.74: compared
    # on confirmed figures, 0.76 confirmed takes the place
    second = promote("run-k2", {0: 0.1, 5: 0.78}, (5, 0.76, "s" * 16))
    assert second["champion"] and second["value"] == 0.76
    assert c.get_model_version("promo-confirm", second["model_version"]).tags[
        "shardrl.eval_figure"] == "confirmed"
    # a confirmation of another version, or of another setup, is passed over
    other = promote("run-k3", {0: 0.1, 5: 0.70, 10: 0.72}, (5, 0.99, "s" * 16))
    assert other["value"] == 0.72 and "selected_value" not in other
    another = promote("run-k4", {0: 0.1, 5: 0.70}, (5, 0.99, "t" * 16))
    assert another["value"] == 0.70 and "selected_value" not in another
    # an unconfirmed figure (best of several) meets the champion's best of several, not its
    # confirmed one: 0.77 against 0.78 stays challenger, though above the confirmed 0.76
    unconfirmed = promote("run-k5", {0: 0.1, 5: 0.77}, None)
    assert not unconfirmed["champion"]
    assert c.get_model_version("promo-confirm", unconfirmed["model_version"]).tags[
        "shardrl.eval_figure"] == "selected"
    assert promote("run-k6", {0: 0.1, 5: 0.79}, None)["champion"]
    # and a confirmed challenger meets an unconfirmed champion on its selection figure
    assert not promote("run-k7", {0: 0.1, 5: 0.785}, (5, 0.90, "s" * 16))["champion"]
    assert promote("run-k8", {0: 0.1, 5: 0.80}, (5, 0.60, "s" * 16))["champion"]
    # the last version's one evaluation is no maximum: it meets a confirmed figure as is
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-confirm, margin: 0.0, "
                     "choose: last}\n")
    last = promote("run-k9", {0: 0.1, 5: 0.90, 10: 0.62}, None)
    assert last["version"] == 10 and last["champion"]  # 0.62 against the confirmed 0.60
    assert c.get_model_version("promo-confirm", last["model_version"]).tags[
        "shardrl.eval_figure"] == "single"


def test_a_move_within_the_standard_errors_is_said_to_be_one(registry, caplog):
    """With margin 0 the champion moves on any difference; when that difference is within one
    standard error of the two figures, promote says so (and registers the error as a tag)."""
    tmp, cfg, store = registry
    named = tmp / "noise.yaml"
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-noise, margin: 0.0, "
                     "choose: last}\n")

    def promote(run_id: str, value: float) -> dict:
        shutil.copytree(store / "runs" / "base", store / "runs" / run_id)
        _fake_evals(store, run_id, {0: 0.1, 5: value}, "n" * 16, se=0.03)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardrl"):
            return _promote_here(named, store, run_id)

    first = promote("run-n1", 0.50)
    assert first["champion"] and first["value_se"] == 0.03
    assert _client(tmp).get_model_version("promo-noise", first["model_version"]).tags[
        "eval.pass_at_1_se"] == "0.03"
    assert "standard error" not in caplog.text  # no champion to compare with
    # +0.02 against a combined error of sqrt(2) x 0.03 = 0.042: moved, and said to be noise
    close = promote("run-n2", 0.52)
    assert close["champion"]
    assert ("eval.pass_at_1 0.520 (± 0.030) against champion version 1's 0.500 (± 0.030): the "
            "difference is within one standard error of it, so the move is not a clear win"
            ) in caplog.text
    # -0.03: kept, also within the noise
    assert not promote("run-n3", 0.49)["champion"]
    assert "keeping the champion is not a clear loss either" in caplog.text
    # +0.10: a clear win, nothing said
    assert promote("run-n4", 0.62)["champion"] and "standard error" not in caplog.text
    # a best-of-several champion reads high by more than its error: nothing said against it
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-noise, margin: 0.0}}\n")
    shutil.copytree(store / "runs" / "base", store / "runs" / "run-n5")
    _fake_evals(store, "run-n5", {0: 0.1, 5: 0.70, 10: 0.65}, "n" * 16, se=0.03)
    assert _promote_here(named, store, "run-n5")["champion"]  # unconfirmed: "selected"
    named.write_text(f"extends: {cfg}\npromote: {{model_name: promo-noise, margin: 0.0, "
                     "choose: last}\n")
    caplog.clear()
    assert promote("run-n6", 0.72)["champion"] and "standard error" not in caplog.text


def _client(tmp: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp}/mlflow.db"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_registered_version_carries_tags_and_loads_with_the_transformers_flavor(registry,
                                                                             monkeypatch):
    import mlflow
    import torch

    from shardrl.models.io import load_causal_lm, load_tokenizer

    tmp, _, store = registry
    mv = _client(tmp).get_model_version("promo-test", "1")
    assert mv.tags["shardrl.run_id"] == "run-a"
    assert mv.tags["shardrl.policy_version"] == "5"
    assert float(mv.tags["eval.pass_at_1"]) == 0.5
    # the evaluation's figures, not its timing or settings, and the figure it was chosen on
    assert {k for k in mv.tags if k.startswith("eval.")} == {
        "eval.pass_at_1", "eval.mean_reward", "eval.mean_length", "eval.selected.pass_at_1"}
    assert mv.tags["shardrl.eval_figure"] == "selected"  # the best of three, unconfirmed
    assert len(mv.tags["shardrl.config_hash"]) == 12
    # set_tracking_uri exports MLFLOW_TRACKING_URI too: monkeypatch puts it back afterwards,
    # or later tests' runs would log here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    local = Path(mlflow.artifacts.download_artifacts(f"models:/promo-test/{mv.version}",
                                                     dst_path=str(tmp / "download")))
    assert "transformers" in (local / "MLmodel").read_text()
    assert list(local.rglob("*.safetensors")) and not list(local.rglob("*.bin"))

    # the pipeline holds exactly the promoted weights (v5 is a copy of v0 here) and generates
    # what the project's own loader generates from them
    ours = store / "runs" / "run-a" / "policy" / "v000000"
    model, tokenizer = load_causal_lm(ours), load_tokenizer(ours)
    pipe = mlflow.transformers.load_model("models:/promo-test@champion")
    theirs = pipe.model.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key
    prompt = "12+30="
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = tokenizer.decode(model.generate(ids, max_new_tokens=4, do_sample=False)[0],
                                skip_special_tokens=True)
    out = pipe(prompt, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert out == expected

    # and as a pyfunc model, with its generation parameters in the signature
    pyfunc = mlflow.pyfunc.load_model(f"models:/promo-test/{mv.version}")
    (text,) = pyfunc.predict([prompt], params={"max_new_tokens": 4, "do_sample": False})
    assert text == expected


def test_a_retried_promote_reuses_its_version(registry):
    tmp, cfg, store = registry
    c = _client(tmp)
    before = sorted(int(v.version) for v in c.search_model_versions("name = 'promo-test'"))
    aliases = _aliases(tmp)
    first = json.loads((store / "runs" / "run-c" / "state" / "promote" / "result.json").read_text())
    _stage("promote", cfg, store, "run-c", tmp)  # as a retry of run-c's promote would
    again = json.loads((store / "runs" / "run-c" / "state" / "promote" / "result.json").read_text())
    assert again == first and again["champion"]
    assert sorted(int(v.version) for v in c.search_model_versions("name = 'promo-test'")) == before
    assert _aliases(tmp) == aliases
    run_c = [v for v in c.search_model_versions("name = 'promo-test'")
             if v.tags["shardrl.run_id"] == "run-c"]
    assert len(run_c) == 1
    # a retry (or a resume) of an older run's promote leaves the aliases where later runs put
    # them: it used to move the challenger back to its own version
    older = json.loads((store / "runs" / "run-a" / "state" / "promote" / "result.json").read_text())
    _stage("promote", cfg, store, "run-a", tmp)
    assert _aliases(tmp) == aliases and int(aliases["challenger"]) > int(older["model_version"])


def test_an_unfinished_or_aborted_run_is_not_promoted(registry):
    """A run whose learner never finished, or which a stage aborted, registers nothing: the
    stage fails with a reason (in a cluster, promote runs once the looping tasks end, and they
    end on the abort marker too)."""
    from shardrl.stages import EXIT_RUN_ABORTED

    tmp, cfg, store = registry
    c = _client(tmp)
    before = sorted(int(v.version) for v in c.search_model_versions("name = 'promo-test'"))
    shutil.copytree(store / "runs" / "base", store / "runs" / "run-x")
    _fake_evals(store, "run-x", {0: 0.1, 5: 0.9})
    (store / "runs" / "run-x" / "DONE.json").unlink()
    out = _stage("promote", cfg, store, "run-x", tmp, status=1)
    assert "the learner has not finished this run" in out, out[-2000:]
    (store / "runs" / "run-x" / "ABORTED.json").write_text(json.dumps(
        {"stage": "rollout", "worker": 1, "exit_code": 1, "restarts": 3, "reason": "out of "
         "restarts", "time": 0.0}))
    out = _stage("promote", cfg, store, "run-x", tmp, status=EXIT_RUN_ABORTED)
    assert "the run was aborted (rollout worker 1 failed for good" in out, out[-2000:]
    assert not (store / "runs" / "run-x" / "state" / "promote").exists()
    assert sorted(int(v.version) for v in c.search_model_versions("name = 'promo-test'")) == before


def test_a_registry_error_is_not_read_as_no_champion():
    """Only 'does not exist' means no champion: a server error or a locked database must
    fail the promotion, not make the challenger champion unchallenged."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE

    from shardrl.stages.promote import _alias

    class Registry:
        def __init__(self, code):
            self.code = code

        def get_model_version_by_alias(self, name, alias):
            raise MlflowException(f"{alias} of {name}", error_code=self.code)

    assert _alias(Registry(INVALID_PARAMETER_VALUE), "m", "champion") is None
    with pytest.raises(MlflowException, match="champion of m"):
        _alias(Registry(INTERNAL_ERROR), "m", "champion")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (SQLite behind it, artifacts served by it)."""
    import socket
    import time
    import urllib.request

    tmp = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1", "--backend-store-uri",
         f"sqlite:///{tmp}/server.db", "--artifacts-destination", str(tmp / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_promote_against_a_real_mlflow_server(registry, mlflow_server):
    """The same champion rule through MLflow's REST API: a missing model and alias come
    back as errors the promote stage tells from real failures."""
    from mlflow.tracking import MlflowClient

    tmp, cfg, store = registry
    # as a pod is given it (MLFLOW_TRACKING_URI wins over the config's `tracking.uri`)
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server)
    results = []
    for run_id, evals in (("srv-a", {0: 0.2, 10: 0.5}), ("srv-b", {0: 0.2, 10: 0.51}),
                          ("srv-c", {0: 0.2, 10: 0.6})):
        shutil.copytree(store / "runs" / "base", store / "runs" / run_id)
        _fake_evals(store, run_id, evals)
        _stage("promote", cfg, store, run_id, tmp, env)
        results.append(json.loads(
            (store / "runs" / run_id / "state" / "promote" / "result.json").read_text()))
    # the first is champion; 0.51 does not beat 0.5 by the margin; 0.6 does
    assert [r["champion"] for r in results] == [True, False, True]
    c = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    aliases = c.get_registered_model("promo-test").aliases
    assert aliases["champion"] == results[2]["model_version"]
    assert aliases["previous-champion"] == results[0]["model_version"]
    assert aliases["challenger"] == results[2]["model_version"]
