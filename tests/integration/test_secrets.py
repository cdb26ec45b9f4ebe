"""Secrets and weights: credentials come only from the environment and never reach a log, the
tracking server or the store; weights load from safetensors only; containers run unprivileged."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e.conftest import TINY
from overlays import render
from shardrl.models.io import UnsafeWeightsError, load_causal_lm, save_model
from shardrl.models.tiny import build_tiny_model, train_tokenizer
from shardrl.stages.policy import MANIFEST, load_policy, upload_folder
from shardrl.store import LocalStore, RunKeys
from shardrl.store.s3 import S3Store


def files_under(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_a_run_with_credentials_leaks_none_of_them(tmp_path, seaweed):
    bucket = "secrets-" + secrets.token_hex(4)
    seaweed.make_bucket(bucket)
    password, token = secrets.token_hex(16), secrets.token_hex(16)
    env = dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               S3_ENDPOINT_URL=seaweed.endpoint, AWS_ACCESS_KEY_ID=seaweed.access_key,
               AWS_SECRET_ACCESS_KEY=seaweed.secret_key, MLFLOW_TRACKING_USERNAME="shardrl",
               MLFLOW_TRACKING_PASSWORD=password, HF_TOKEN=token)
    values = {"AWS_SECRET_ACCESS_KEY": seaweed.secret_key, "MLFLOW_TRACKING_PASSWORD": password,
              "HF_TOKEN": token, "AWS_ACCESS_KEY_ID": seaweed.access_key}
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY + f"tracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    res = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "run", str(config), "--run-id", "creds",
         "--store", f"s3://{bucket}/runs", "--no-progress", "--set", "learner.total_steps=2",
         "--set", "eval.every=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    # everything the run left: its output, stage logs, the MLflow database and artifacts,
    # and every object of the run in the store (run.json and the state files among them)
    texts = {"stdout": res.stdout.encode(), "stderr": res.stderr.encode()}
    for path in files_under(tmp_path / ".shardrl", tmp_path / "mlartifacts"):
        texts[str(path)] = path.read_bytes()
    texts["mlflow.db"] = (tmp_path / "mlflow.db").read_bytes()
    store = S3Store(bucket, "runs", seaweed.endpoint, seaweed.access_key, seaweed.secret_key)
    keys = RunKeys("creds")
    objects = store.list(keys.root)
    assert keys.run_json() in objects and any("/logs/" in t for t in texts)
    for key in objects:
        if not key.endswith((".safetensors", ".parquet")):  # weights and shards hold numbers
            texts[key] = store.get_bytes(key)
    # MLflow params and tags, through the client as a user would read them
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].data.params
    texts["mlflow params and tags"] = repr((runs[0].data.params, runs[0].data.tags)).encode()
    for where, data in texts.items():
        for name, value in values.items():
            assert value.encode() not in data, f"{name} leaked into {where}"


def _malicious_pickle(path: Path, marker: Path) -> None:
    """A `.bin` checkpoint whose unpickling would create `marker` (as a real attack would run
    code of its choice)."""

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"model.embed_tokens.weight": Payload()}, path)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    tokenizer = train_tokenizer(["0123456789+="], tmp_path / "tok")
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=16, max_position_embeddings=32, seed=0)
    folder = tmp_path / "model"
    save_model(model, tokenizer, folder)
    return folder


def test_planted_pickle_weights_are_refused_and_never_unpickled(model_dir, tmp_path):
    marker = tmp_path / "pwned"
    _malicious_pickle(model_dir / "pytorch_model.bin", marker)
    with pytest.raises(UnsafeWeightsError, match=r"pytorch_model\.bin"):
        load_causal_lm(model_dir)
    # a published policy folder holding a pickle (listed in its manifest, so only the pickle
    # check can stop it) is refused by every stage that loads the policy
    store, keys = LocalStore(tmp_path / "store"), RunKeys("r")
    with pytest.raises(UnsafeWeightsError):
        upload_folder(store, keys.policy_prefix(0), model_dir)
    (model_dir / "pytorch_model.bin").rename(tmp_path / "pytorch_model.bin")
    upload_folder(store, keys.policy_prefix(0), model_dir)
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    store.put_bytes(keys.policy_file(0, "pytorch_model.bin"), data)
    manifest = store.get_json(keys.policy_file(0, MANIFEST))
    manifest["files"]["pytorch_model.bin"] = hashlib.sha256(data).hexdigest()
    store.put_json(keys.policy_file(0, MANIFEST), manifest)
    with pytest.raises(UnsafeWeightsError, match="pickle"):
        load_policy(store, keys, 0, tmp_path / "cache")
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("overlay", ["kubeflow", "standalone"])
def test_rendered_manifests_run_unprivileged_and_take_credentials_from_secrets(overlay, tmp_path):
    objects, _ = render(tmp_path, overlay)  # with the credentials the generator writes
    pods = [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects
            if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")]
    assert pods
    secret_like = ("KEY", "SECRET", "PASSWORD", "TOKEN")
    for name, spec in pods:
        pod_ctx = spec.get("securityContext", {})
        for c in spec.get("initContainers", []) + spec["containers"]:
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            where = f"{overlay}/{name}/{c['name']}"
            assert ctx.get("runAsNonRoot") is True, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not ctx.get("capabilities", {}).get("add"), where
            assert not ctx.get("privileged", False), where
            for var in c.get("env", []):
                if any(word in var["name"].upper() for word in secret_like):
                    assert "value" not in var, f"{where}: {var['name']} is written in plain text"
                    assert "secretKeyRef" in var.get("valueFrom", {}), (where, var["name"])
    # credentials live in Secrets only, never in a ConfigMap
    for o in objects:
        if o["kind"] == "ConfigMap":
            for key in o.get("data", {}):
                assert not any(word in key.upper() for word in secret_like), (o["metadata"], key)


def test_credentials_come_from_the_environment_only(tmp_path, monkeypatch):
    """The store takes its keys from the environment; a config cannot carry them."""
    from shardrl.config import ConfigError, load_config
    from shardrl.store import PermanentStoreError, open_store

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SHARDRL_AWS_ACCESS_KEY_ID",
                 "SHARDRL_AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PermanentStoreError, match="no credentials .* set AWS_ACCESS_KEY_ID"):
        open_store("s3://bucket/prefix")
    config = tmp_path / "c.yaml"
    config.write_text("extends: demo\nstore: {uri: 's3://b/p', secret_key: 'x'}\n")
    with pytest.raises(ConfigError, match="store.secret_key"):
        load_config(str(config))


def test_credentials_written_into_a_url_reach_neither_params_nor_messages(monkeypatch):
    """A tracking URI such as https://user:token@host would have been logged as an MLflow
    param and printed; an S3 endpoint with user:password@ is refused without echoing it."""
    from shardrl.redact import has_userinfo
    from shardrl.store import PermanentStoreError
    from shardrl.tracking.mlflow_run import redacted

    assert redacted("https://ci-bot:s3cr3t@mlflow.example:5000/x") == \
        "https://***@mlflow.example:5000/x"
    assert redacted("sqlite:///runs/mlflow.db") == "sqlite:///runs/mlflow.db"
    assert redacted("s3://bucket/prefix and http://a@b/") == "s3://bucket/prefix and http://***@b/"
    # a password with "/" (base64, generated ones): database drivers read it as a password
    assert redacted("postgresql://mlflow:ab/cd@db.example/mlflow and more") == \
        "postgresql://***@db.example/mlflow and more"
    assert redacted("mysql://u:p@ss/w0rd@db/m") == "mysql://***@db/m"
    assert redacted("sqlite:////tmp/x@y/mlflow.db https://host/a@b") == \
        "sqlite:////tmp/x@y/mlflow.db https://host/a@b"
    # a password with "/" and a comma or a quote is masked too, and refused in a config
    for url in ("postgresql://u:p,a/b@db/x", "postgresql://u:p'a/b@db/x"):
        assert redacted(url) == "postgresql://***@db/x" and has_userinfo(url), url
    # and the search stays linear: 16,000 addresses on one line took minutes
    import time

    line = ",".join(f"http://host{i}:8080/p" for i in range(16_000))
    started = time.monotonic()
    assert redacted(line) == line
    assert time.monotonic() - started < 10
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with pytest.raises(PermanentStoreError) as caught:
        S3Store("bucket", endpoint="http://admin:hunter22@127.0.0.1:9")
    assert "hunter22" not in str(caught.value) and "holds credentials" in str(caught.value)


def test_a_config_refuses_credentials_in_its_addresses():
    """The config is copied into run.json, logs, pod command lines and the pipelines'
    parameters: an address holding user:password@ is refused, without being echoed."""
    from shardrl.config import ConfigError, load_config

    for setting in ("tracking.uri=https://ci:hunter22@mlflow.example",
                    "tracking.uri=postgresql://mlflow:hunter22/x@db.example/mlflow",
                    "pipeline.ui_endpoint=https://u:hunter22@kubeflow.example"):
        with pytest.raises(ConfigError) as caught:
            load_config("demo", [setting])
        assert "hunter22" not in str(caught.value) and "holds credentials" in str(caught.value)
    assert load_config("demo", ["tracking.uri=https://mlflow.example"]).tracking.uri == \
        "https://mlflow.example"


def test_credentials_in_library_errors_are_masked_in_logs_and_messages(tmp_path):
    """A library's error quoting an address with its credentials (MLflow's "API request to
    https://user:token@host failed") is masked in stage logs, tracebacks included, and in
    the runner's quote of a failed stage."""
    import logging

    from shardrl.orchestrate.local import last_error
    from shardrl.redact import redacted, without_userinfo
    from shardrl.stages.context import RedactingFormatter

    assert redacted("https://bot:p@ss@host:5000/x?token=abc&page=2") == \
        "https://***@host:5000/x?token=***&page=2"
    assert without_userinfo("https://u:p@kubeflow.example/pipeline") == \
        "https://kubeflow.example/pipeline"
    try:
        raise RuntimeError("API request to https://ci:hunter22@mlflow.example/api failed")
    except RuntimeError:
        import sys as _sys

        record = logging.LogRecord("shardrl.promote", logging.ERROR, __file__, 1,
                                   "registering failed at %s", ("https://ci:hunter22@m.example",),
                                   _sys.exc_info())
    text = RedactingFormatter("%(message)s").format(record)
    assert "hunter22" not in text and "https://***@m.example" in text
    assert "RuntimeError: API request to https://***@mlflow.example/api failed" in text
    log = tmp_path / "promote.log"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "MlflowException: API request to https://ci:hunter22@mlflow.example failed\n")
    assert last_error(log) == ": MlflowException: API request to https://***@mlflow.example failed"


def test_pipeline_run_refuses_a_kfp_host_with_credentials(monkeypatch, capsys):
    from shardrl.cli import main as cli_main

    monkeypatch.setenv("KFP_HOST", "https://u:hunter22@kubeflow.example")
    monkeypatch.delenv("KF_PIPELINES_UI_ENDPOINT", raising=False)
    assert cli_main(["pipeline", "run", "demo"]) == 1
    captured = capsys.readouterr()
    assert "KFP_HOST holds credentials" in captured.err
    assert "hunter22" not in captured.err + captured.out


def test_mlflow_params_carry_no_url_credentials(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from shardrl.config import load_config
    from shardrl.tracking.mlflow_run import find_or_create_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = tmp_path / "c.yaml"
    config.write_text(f"extends: demo\ntracking: {{uri: '{uri}', "
                      "experiment: 'https://u:tok3n@host'}\n")
    cfg = load_config(str(config))
    run = find_or_create_run(cfg, "redact")
    params = MlflowClient(tracking_uri=uri).get_run(run).data.params
    assert params and not any("tok3n" in v for v in params.values())


def test_temporary_credentials_take_their_session_token(monkeypatch):
    from shardrl.store import open_store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ASIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-from-sts")
    store = open_store("s3://bucket/prefix")
    credentials = store._client._provider.retrieve()
    assert (credentials.access_key, credentials.session_token) == ("ASIAEXAMPLE", "token-from-sts")
    assert "token-from-sts" not in repr(store)
    assert store.reopened()._client._provider.retrieve().session_token == "token-from-sts"


def test_a_store_uri_with_credentials_is_refused_without_echoing_them(tmp_path, capsys):
    """`--store s3://KEY:SECRET@bucket/prefix` would be quoted in errors, run.json and logs."""
    from shardrl.cli import main as cli_main
    from shardrl.config import ConfigError, load_config
    from shardrl.store import StoreURIError, open_store

    uri = "s3://AKIAEXAMPLE:hunter22@bucket/exp"
    with pytest.raises(StoreURIError) as caught:
        open_store(uri)
    assert "hunter22" not in str(caught.value) and "holds credentials" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config("demo", [f"store.uri={uri}"])
    assert "hunter22" not in str(caught.value) and "holds credentials" in str(caught.value)
    for argv in (["run", "demo", "--store", uri, "--no-report"], ["replay", "r1", "--store", uri]):
        assert cli_main(argv) == 1
        captured = capsys.readouterr()
        assert "holds credentials" in captured.err
        assert "hunter22" not in captured.err + captured.out
    for command in ("doctor", "report", "samples"):  # one line through SystemExit
        with pytest.raises(SystemExit) as exited:
            cli_main([command, "r1", "--store", uri])
        assert "holds credentials" in str(exited.value.code)
        assert "hunter22" not in str(exited.value.code) + "".join(capsys.readouterr())


def test_an_unreachable_mlflow_is_one_masked_line_and_leaves_no_run(tmp_path):
    """MLflow's own error quotes the tracking URI, credentials and all: the runner says it in
    one line with them masked, exits 1, and the run id stays free for the next try."""
    env = dict(os.environ, MLFLOW_TRACKING_URI="http://bot:hunter22@127.0.0.1:9",
               MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    res = subprocess.run([sys.executable, "-m", "shardrl.cli", "run", "demo", "--run-id", "m1",
                          "--store", str(tmp_path / "store"), "--no-report"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "hunter22" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardrl run: MLflow at http://***@127.0.0.1:9 "
                                                   "failed: ")
    assert "set tracking.enabled=false" in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "store" / "runs" / "m1" / "state" / "runner" / "started.json").exists()


def test_uncaught_errors_are_masked_in_every_thread():
    """Tracebacks no ShardRL handler catches, of the main thread (every entry point goes
    through `run_and_leave`) and of other threads, have credentials masked."""
    code = ("import threading\n"
            "from shardrl.cli import run_and_leave\n"
            "def boom(): raise RuntimeError('API request to https://ci:hunter22@m.example failed')\n"
            "def main():\n"
            "    t = threading.Thread(target=boom, name='side'); t.start(); t.join()\n"
            "    boom()\n"
            "run_and_leave(main)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1
    assert "hunter22" not in res.stderr
    assert "Exception in thread side:" in res.stderr
    assert res.stderr.count("RuntimeError: API request to https://***@m.example failed") == 2


def test_commands_that_read_a_run_say_a_store_problem_in_one_line(monkeypatch, capsys):
    """Missing credentials or a malformed run id: one line, not a traceback."""
    from shardrl.cli import main as cli_main

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SHARDRL_AWS_ACCESS_KEY_ID",
                 "SHARDRL_AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        cli_main(["doctor", "r1", "--store", "s3://some-bucket/x"])
    assert str(exited.value.code).startswith("shardrl: no credentials for bucket 'some-bucket'")
    assert cli_main(["replay", "r1", "--store", "s3://some-bucket/x"]) == 1
    assert capsys.readouterr().err.startswith("shardrl replay: no credentials for bucket")
    assert cli_main(["replay", "../x", "--store", "s3://some-bucket/x"]) == 2
    assert "run_id must match" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["demo", "scalerl", "ppo-rlhf", "smollm2", "calculator"])
def test_a_config_comes_back_whole_from_its_mlflow_params(tmp_path, preset, caplog):
    """`shardrl doctor <MLflow run id>` rebuilds the run's config from its params: lists of
    mappings holding None (the GPU tolerations) were logged as Python's repr and came back
    as the text 'None', so the pipeline section was dropped with a warning."""
    from mlflow.tracking import MlflowClient

    from shardrl.config import load_config
    from shardrl.doctor.series import mlflow_config
    from shardrl.tracking.mlflow_run import find_or_create_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(preset, [f"tracking.uri={uri}"])
    run = find_or_create_run(cfg, "params")
    with caplog.at_level("WARNING"):
        back = mlflow_config(MlflowClient(tracking_uri=uri), run)
    assert not [r for r in caplog.records if "does not validate" in r.getMessage()]
    assert back.pipeline == cfg.pipeline and back.algo == cfg.algo and back.model == cfg.model
