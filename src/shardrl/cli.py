"""`shardrl` command line. Arguments are parsed before any heavy import, so --help is instant."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from .graph import STAGE_NAMES
from .lifetime import die_with_launcher
from .quiet import QUIET_LIBRARIES_ENV


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set learner.lr=1e-4 (repeatable)")


def store_uri(text: str) -> str:
    """A store URI argument: not empty (an empty one would quietly mean the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a folder or s3://bucket/prefix")
    return text


def kfp_run_name(text: str) -> str:
    """`pipeline run --run-name`: not empty (Makefile's empty `RUN_NAME` passes no flag)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the run's name, or leave the flag out")
    return text


def positive(text: str) -> int:
    """An argument that must be a whole number >= 1."""
    return _at_least(text, 1)


def non_negative(text: str) -> int:
    """An argument that must be a whole number >= 0."""
    return _at_least(text, 0)


def _stage_list(text: str) -> tuple[str, ...]:
    """An argument naming stages, comma-separated."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STAGE_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'no stage'}: name stages among {', '.join(STAGE_NAMES)}")
    return names


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
    return value


def run_id(text: str) -> str:
    """An argument naming a run: one safe key segment (the store's rule, `RunKeys`)."""
    from .store.keys import RunKeys  # the store's modules only when the argument is given

    try:
        return RunKeys(text).run_id
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardrl",
        description="Asynchronous RL fine-tuning of language models as a pipeline of stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cfg = sub.add_parser("config", help="show or validate a run config")
    cfg_sub = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the resolved config (presets and overrides merged)")
    show.add_argument("file", help="config file or preset name")
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    _add_overrides(show)
    val = cfg_sub.add_parser("validate", help="exit non-zero and list every error by field path")
    val.add_argument("files", nargs="+", help="config files or preset names")
    _add_overrides(val)

    run = sub.add_parser("run", help="run the whole pipeline locally (stages as subprocesses)")
    run.add_argument("config", nargs="?", help="config file or preset name")
    run.add_argument("--run-id", help="run id (default: derived from the config name and time)")
    run.add_argument("--store", type=store_uri,
                     help="store URI overriding store.uri (folder or s3://bucket/prefix)")
    run.add_argument("--create-bucket", action="store_true",
                     help="create the S3 bucket of --store when it does not exist")
    run.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted run from the store")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a bar")
    run.add_argument("--no-report", action="store_true",
                     help="skip the closing report (plots, doctor findings)")
    _add_overrides(run)

    st = sub.add_parser("stage", help="run one stage (what a pod or the local runner executes)")
    st.add_argument("name", choices=STAGE_NAMES)
    st.add_argument("--config", required=True, help="config file, preset name, or inline YAML")
    st.add_argument("--run-id", required=True)
    st.add_argument("--store", type=store_uri, help="store URI overriding store.uri")
    st.add_argument("--worker", type=non_negative, default=0, help="replica index (0-based)")
    st.add_argument("--workers", type=positive, default=None,
                    help="number of replicas (default 1; when given, a replicated stage checks "
                         "it against the config's)")
    st.add_argument("--once", action="store_true",
                    help="do one synchronous round of work and exit (sync pipeline)")
    st.add_argument("--stages", type=_stage_list, default=None,
                    help="the stages a compiled pipeline runs, comma-separated: the stage "
                         "refuses a config that needs other stages (their shards would never "
                         "be written)")
    st.add_argument("--supervise", action="store_true",
                    help="run the stage as a child process and restart it when it crashes, "
                         "with backoff, up to pipeline.max_restarts (what a pipeline pod runs)")
    _add_overrides(st)

    pl = sub.add_parser("pipeline", help="compile or submit the Kubeflow pipelines")
    pl_sub = pl.add_subparsers(dest="action", required=True, metavar="ACTION")
    comp = pl_sub.add_parser("compile", help="write the pipeline IR YAML")
    comp.add_argument("--config", default="demo",
                      help="config whose stage graph, resources and defaults are compiled in")
    comp.add_argument("--out-dir", default="build/pipelines")
    comp.add_argument("--kubernetes-manifest-format", action="store_true",
                      help="also write Kubernetes-manifest form")
    comp.add_argument("--image-registry", help="override the image registry")
    comp.add_argument("--image-tag", help="override the image tag (default: VERSION-gREV)")
    sub_run = pl_sub.add_parser("run", help="submit to KFP_HOST, or run locally when it is unset")
    sub_run.add_argument("config", help="config file or preset name")
    sub_run.add_argument("--experiment", default="shardrl")
    sub_run.add_argument("--pipeline", default="shardrl", choices=("shardrl", "shardrl-sync"))
    sub_run.add_argument("--wait", action="store_true", help="wait and fail if the run fails")
    sub_run.add_argument("--run-name", type=kfp_run_name, metavar="NAME",
                         help="the run's name in its experiment; a run of that name there is "
                              "taken as this submission and none is started (a retried CI job "
                              "follows its first try's run); default: the config's name, the "
                              "time and a random suffix")
    sub_run.add_argument("--image-registry", help="override the image registry")
    sub_run.add_argument("--image-tag", help="override the image tag (default: VERSION-gREV)")
    sub_run.add_argument("--require-cluster", action="store_true",
                         help="fail when KFP_HOST is unset instead of running locally "
                              "(also REQUIRE_CLUSTER=1)")

    mdl = sub.add_parser("model", help="prepare model folders for `model.source`")
    mdl_sub = mdl.add_subparsers(dest="action", required=True, metavar="ACTION")
    gg = mdl_sub.add_parser("import-gguf", help="write a GGUF file as a safetensors Hugging "
                            "Face folder (config, weights, tokenizer, chat template)")
    gg.add_argument("file", help="the .gguf file")
    gg.add_argument("--out", required=True, help="folder to write (must be absent or empty, or give --force)")
    gg.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the written weights (default float32)")
    gg.add_argument("--force", action="store_true", help="replace --out if it exists")

    doc = sub.add_parser("doctor", help="diagnose a run from its metrics")
    doc.add_argument("run", help="run id (in the store) or MLflow run id")
    doc.add_argument("--store", type=store_uri, help="store URI (default: runs)")
    doc.add_argument("--json", action="store_true", help="machine-readable output")

    rep = sub.add_parser("report", help="plots, findings and the scaling-curve fit of a run")
    rep.add_argument("run", help="run id")
    rep.add_argument("--store", type=store_uri, help="store URI (default: runs)")
    rep.add_argument("--out", help="output folder (default: the run's report/ folder)")
    rep.add_argument("--fit", action="store_true", help="print the compute->performance fit only")

    rp = sub.add_parser("replay", help="re-run a run's learner from its ledger: verify it "
                        "bit for bit, or try a config change on the same shards")
    rp.add_argument("run", help="run id of the run to replay")
    rp.add_argument("--store", type=store_uri, help="store URI (default: runs)")
    rp.add_argument("--to-version", type=positive, metavar="N", help="stop after version N")
    rp.add_argument("--verify", action="store_true",
                    help="check that each version the run still holds is published bit for bit")
    rp.add_argument("--run-id", type=run_id,
                    help="id of the new run (default: RUN-replay-<time>-<4 hex digits>)")
    rp.add_argument("--no-eval", action="store_true",
                    help="with --set: do not evaluate the new run's versions")
    _add_overrides(rp)

    smp = sub.add_parser("samples", help="audit generated samples of a run")
    smp.add_argument("run", help="run id")
    smp.add_argument("--store", type=store_uri, help="store URI (default: runs)")
    smp.add_argument("--version", type=non_negative,
                     help="policy version (default: latest with data)")
    order = smp.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true")
    order.add_argument("--best", action="store_true")
    order.add_argument("--random", action="store_true")
    smp.add_argument("-n", type=positive, default=10, help="rows to show")
    return parser


# command -> module with `run(args) -> int`; imported only after parsing
_HANDLERS = {
    "config": "shardrl.commands.config_cmd",
    "run": "shardrl.orchestrate.local",
    "stage": "shardrl.stages",
    "pipeline": "shardrl.commands.pipeline_cmd",
    "model": "shardrl.commands.model_cmd",
    "doctor": "shardrl.doctor.cli",
    "report": "shardrl.doctor.report",
    "samples": "shardrl.doctor.samples",
    "replay": "shardrl.commands.replay_cmd",
}


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    for name, value in QUIET_LIBRARIES_ENV.items():  # before any library reads them
        os.environ.setdefault(name, value)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        # OpenMP reads this once, as torch loads: in the runner, whose forked stages keep it
        # (their own setting, `LocalRunner.placement`, would come too late for them)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.command == "stage":
        args.workers_stated = args.workers is not None
        args.workers = args.workers or 1
    if args.command == "stage" and args.worker >= args.workers:  # it would wait for ever
        parser.error(f"--worker {args.worker} is not below --workers {args.workers}")
    handler = _HANDLERS[args.command]
    if args.command == "stage" and args.supervise:  # restart the stage in this container
        handler = "shardrl.orchestrate.supervise"
    module = importlib.import_module(handler)
    return int(module.run(args) or 0)


def leave(code: int) -> NoReturn:
    """End the process with `code` once its work is done, without the interpreter's
    teardown. As the interpreter's own exit does first, threads not marked daemon are
    waited for (with the thread pools' pending work) and the exit handlers run (logging,
    multiprocessing, MLflow's); then the standard streams are flushed and `os._exit`. In the
    teardown, Arrow's worker threads abort the process once in a while after Parquet was
    read ("terminate called without an active exception", apache/arrow#34314; on a 2-core
    machine about half the commands whose last act was such a read): exit 134 after a stage
    or a run had finished and committed everything, which the local runner or Kubeflow then
    counts as a crash and retries."""
    try:
        threading._shutdown()  # what the interpreter's exit calls before the exit handlers
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def run_and_leave(main: Callable[[], int | None]) -> NoReturn:
    """`main()`, then `leave` with its exit code, also when it ends by `SystemExit` (an
    argument error, say) or by Ctrl-C (130, the shell's status, without a traceback); any
    other exception ends the process the usual way, traceback and all, with credentials in
    it masked (`redact.redact_tracebacks`). The entry point of every ShardRL process
    (`shardrl`, the Kubeflow tasks)."""
    from .redact import redact_tracebacks

    redact_tracebacks()
    try:
        code = main() or 0
    except KeyboardInterrupt:  # Ctrl-C where the command has no handler of its own
        print("interrupted", file=sys.stderr)
        code = 130
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # a message: printed as the interpreter would
            print(e.code, file=sys.stderr)
            code = 1
    leave(code)


def entry() -> None:
    """The `shardrl` command."""
    run_and_leave(lambda: main())  # `main` looked up when called


if __name__ == "__main__":
    entry()
