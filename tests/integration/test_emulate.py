"""`pipelines.emulate` on small compiled pipelines of shell tasks: placeholders, Secrets,
ParallelFor limits, the retry policy, and fail-fast. (The ShardRL pipelines themselves run
through it in tests/e2e/test_kfp_emulate.py.)"""

# No `from __future__ import annotations`: KFP reads the inputs' types from annotations.

import subprocess
import sys
from pathlib import Path

import yaml
from kfp import compiler, dsl, kubernetes

ROOT = Path(__file__).resolve().parents[2]


@dsl.container_component
def attempt(folder: str, item: int) -> dsl.ContainerSpec:
    """Fails on its first attempt per item; records start and end times of each attempt."""
    script = ('date +%s.%N >> "$0/start-$1"; sleep 0.5; date +%s.%N >> "$0/end-$1"; '
              'test "$(wc -l < "$0/start-$1")" -ge 2')
    return dsl.ContainerSpec(image="example.org/sh:1", command=["sh", "-c", script],
                             args=[folder, item])


@dsl.container_component
def report(folder: str, run_id: str) -> dsl.ContainerSpec:
    script = 'printf "%s %s %s" "$1" "$TOKEN" "${HOME}" > "$0/report"; env > "$0/env"'
    return dsl.ContainerSpec(image="example.org/sh:1", command=["sh", "-c", script],
                             args=[folder, run_id])


@dsl.container_component
def fail() -> dsl.ContainerSpec:
    return dsl.ContainerSpec(image="example.org/sh:1", command=["sh", "-c", "exit 3"])


@dsl.pipeline(name="emulated")
def loop_then_report(folder: str):
    with dsl.ParallelFor(items=[0, 1, 2], parallelism=2) as item:
        task = attempt(folder=folder, item=item)
        task.set_retry(num_retries=1, backoff_duration="1s", backoff_factor=2.0)
    last = report(folder=folder, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER).after(task)
    kubernetes.use_secret_as_env(last, secret_name="creds", secret_key_to_env={"token": "TOKEN"})


@dsl.pipeline(name="failing")
def fail_fast(folder: str):
    first = fail()
    report(folder=folder, run_id="x").after(first)


def emulate(pipeline, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp / "pipeline.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    return subprocess.run([sys.executable, "-m", "pipelines.emulate", str(path),
                           "--work-dir", str(tmp / "work"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_parallel_for_retries_placeholders_and_secrets(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump({"creds": {"token": "s3cr3t"}}))
    (tmp_path / "folder.txt").write_text(str(out))
    res = emulate(loop_then_report, tmp_path, "--param", f"folder=@{tmp_path / 'folder.txt'}",
                  "--secrets", str(tmp_path / "secrets.yaml"), "--job-uuid", "job-123")
    assert res.returncode == 0, res.stdout + res.stderr
    # every item failed once and was retried after the compiled 1 s backoff
    for item in range(3):
        starts = [float(t) for t in (out / f"start-{item}").read_text().split()]
        ends = [float(t) for t in (out / f"end-{item}").read_text().split()]
        assert len(starts) == 2 and starts[1] - ends[0] >= 1.0
    assert res.stdout.count("retrying in 1 s (1/1)") == 3
    # at most two iterations at a time (parallelism=2)
    spans = [(float(s), float(e)) for i in range(3) for s, e in zip(
        (out / f"start-{i}").read_text().split(), (out / f"end-{i}").read_text().split(),
        strict=True)]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2
    # the job uuid placeholder, the Secret as env, a fresh HOME, nothing of this environment
    job, token, home = (out / "report").read_text().split()
    assert (job, token) == ("job-123", "s3cr3t")
    assert Path(home).parent == tmp_path / "work" / "pods"
    env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines()
               if "=" in line)
    assert "VIRTUAL_ENV" not in env and "PYTEST_CURRENT_TEST" not in env


def test_a_missing_secret_fails_and_a_failed_task_stops_the_run(tmp_path):
    (tmp_path / "out").mkdir()
    res = emulate(loop_then_report, tmp_path, "--param", f"folder={tmp_path / 'out'}")
    assert res.returncode == 2 and "secret 'creds'" in res.stderr
    res = emulate(fail_fast, tmp_path, "--param", f"folder={tmp_path / 'out'}")
    assert res.returncode == 1
    assert "failing/fail: exited with 3" in res.stdout and "FAILED" in res.stdout
    assert not (tmp_path / "out" / "report").exists()  # its dependent never started
