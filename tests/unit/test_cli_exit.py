"""The `shardrl` command's exit: its code, exit handlers run, no abort in the teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

COMMAND = textwrap.dedent("""
    import atexit, io, sys
    import pyarrow as pa, pyarrow.parquet as pq
    import shardrl.store
    from shardrl import cli

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"name": ["x"] * 100, "step": list(range(100))}), sink)
    data = sink.getvalue().to_pybytes()
    atexit.register(lambda: print("exit handler ran", flush=True))

    def main(argv=None):
        # the command's last act reads Parquet on Arrow's thread pool, as the runner's
        # monitor and the learner's doctor do
        assert pq.read_table(io.BytesIO(data)).num_rows == 100
        return CODE

    cli.main = main
    sys.argv = ["shardrl", "stage", "learn"]
    cli.entry()
""")


@pytest.mark.parametrize("code", [0, 3])
def test_a_command_ends_with_its_code_after_arrow_reads(code):
    # Without `leave`, about half of these processes aborted in the interpreter's teardown
    # (exit -6 on this machine); eight at once make one such abort almost certain to show.
    procs = [subprocess.Popen([sys.executable, "-c", COMMAND.replace("CODE", str(code))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == code, err
        assert out == "exit handler ran\n"
        assert "terminate called" not in err


def test_system_exit_codes_are_kept():
    def run(body: str) -> subprocess.CompletedProcess:
        script = ("import sys\nfrom shardrl import cli\n"
                  f"def main(argv=None):\n    {body}\n"
                  "cli.main = main\ncli.entry()\n")
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)

    assert run("raise SystemExit(2)").returncode == 2
    assert run("raise SystemExit(None)").returncode == 0
    r = run("raise SystemExit('no such run')")
    assert (r.returncode, r.stderr) == (1, "no such run\n")
    r = run("raise ValueError('boom')")
    assert r.returncode == 1 and "ValueError: boom" in r.stderr


def test_pending_thread_work_finishes_before_the_exit(tmp_path):
    # a write still queued on a thread pool when the command returns is done, as in a
    # normal interpreter exit
    out = tmp_path / "late.txt"
    script = textwrap.dedent(f"""
        import time
        from concurrent.futures import ThreadPoolExecutor
        from shardrl import cli

        def main(argv=None):
            pool = ThreadPoolExecutor(1)
            pool.submit(lambda: (time.sleep(0.3), open({str(out)!r}, "w").write("done")))
            return 0

        cli.main = main
        cli.entry()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "done"


def test_kubeflow_tasks_end_through_leave_with_their_code():
    # the tasks' entry point is `run_and_leave` too: an argument error keeps its exit code 2
    r = subprocess.run([sys.executable, "-m", "shardrl.orchestrate.kfp_tasks", "report",
                        "--config", "demo", "--run-id", "x"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "report needs --executor-input, --metrics and --html" in r.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["samples", "r1", "--version", "-1"], "argument --version: expected a whole number >= 0"),
    (["samples", "r1", "-n", "0"], "argument -n: expected a whole number >= 1, got 0"),
    (["replay", "r1", "--to-version", "-5"], "argument --to-version: expected a whole number"),
    (["replay", "r1", "--run-id", "a/b"], "argument --run-id: run_id must match"),
    # an empty store used to mean the default store, silently
    (["run", "demo", "--store", ""], "argument --store: is empty: give a folder or s3://"),
    (["doctor", "r1", "--store", " "], "argument --store: is empty"),
])
def test_bad_arguments_are_refused_by_the_parser(argv, message, capsys):
    from shardrl.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_pipeline_commands_report_a_bad_config_or_output_folder_in_one_line(tmp_path, capsys):
    import argparse

    from shardrl.commands.pipeline_cmd import run

    args = argparse.Namespace(action="compile", config=str(tmp_path / "nosuch.yaml"),
                              out_dir=str(tmp_path), image_registry=None, image_tag=None,
                              kubernetes_manifest_format=False)
    assert run(args) == 1 and "file not found" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    args.config, args.out_dir = None, str(tmp_path / "afile")
    assert run(args) == 1 and "shardrl pipeline: " in capsys.readouterr().err


def test_a_stage_replica_must_be_below_the_replica_count(capsys):
    from shardrl.cli import main

    with pytest.raises(SystemExit) as info:
        main(["stage", "rollout", "--config", "demo", "--run-id", "x", "--worker", "5",
              "--workers", "2"])
    assert info.value.code == 2
    assert "--worker 5 is not below --workers 2" in capsys.readouterr().err
