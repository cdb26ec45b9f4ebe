"""`shardrl stage NAME --supervise`: restart a crashed stage inside its container.

The compiled pipelines run every looping stage under this supervisor. It starts the stage as
a child process (the same command line without `--supervise`) and restarts it when it exits
with an error (not when it found the run's config invalid: status 2), after the local
runner's backoff (`restart_delay`: 1, 2, 4, ... 30 s), at most `pipeline.max_restarts` times.
A stage therefore comes back within seconds, however long it has run, without waiting for the
cluster's retry policy (which measures its window from the task's first start and does not
cover evictions).

Out of restarts, the supervisor writes the run's abort marker (`ABORTED.json`) and exits with
the stage's status: every other looping stage sees the marker and stops, so no pod waits for
work that will never come. A stage that gave up on the object store (status 75) is restarted
only if the store answers again; a child that exits because the run was aborted or because the
pod is being stopped (SIGTERM, forwarded to it) is not restarted.

Once the run is aborted, every supervised task fails: a stage that stopped on the marker exits
0 by itself, and its supervisor turns that into `EXIT_RUN_ABORTED`, so the cluster shows the
run as failed and nothing after the loop (promote) runs on an unfinished run. A supervisor that
starts on an aborted run (the cluster's retry of the failed task) exits the same way without
starting its stage.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from ..config import ConfigError
from ..graph import entrypoint
from ..lifetime import die_with_parent
from ..stages import EXIT_CONFIG, EXIT_RUN_ABORTED, EXIT_STORE_UNAVAILABLE, launch_refused
from ..stages.context import load_stage_config, release_cache, retry_policy, setup_logging
from ..store import RunKeys, StoreUnavailable, open_store
from ..store.records import Aborted
from .local import restart_delay


def child_command(args) -> list[str]:
    """The stage's own command line (without `--supervise`), run by this interpreter."""
    argv = entrypoint(args.name, config=args.config, run_id=args.run_id, store=args.store,
                      worker=args.worker, workers=args.workers, once=args.once,
                      stages=getattr(args, "stages", None))
    for item in args.overrides:
        argv += ["--set", item]
    return [sys.executable, "-m", "shardrl.cli", *argv[1:]]


def exit_status(code: int) -> int:
    """A child's status as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - code if code < 0 else code


def run(args) -> int:
    try:
        cfg = load_stage_config(args.config, args.overrides)
    except ConfigError as exc:  # the child would fail alike, at every restart
        print(f"shardrl stage {args.name}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if (refused := launch_refused(args, cfg)) is not None:  # the child would refuse alike
        print(f"shardrl stage {args.name}: {refused}", file=sys.stderr)
        return EXIT_CONFIG
    log = setup_logging(f"{args.name}-supervisor", args.worker)
    store = open_store(args.store or cfg.store.uri, retry_policy(cfg))
    keys = RunKeys(args.run_id)
    limit = cfg.pipeline.max_restarts
    command = child_command(args)
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def forward(signum, frame):  # noqa: ARG001 - a signal handler's signature
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    if (marker := Aborted.read(store, keys.aborted(), optional=True)) is not None:
        log.error("the run was aborted (%s): %s not started; resume the run once the cause "
                  "is fixed", marker.describe(), args.name)
        return EXIT_RUN_ABORTED
    restarts = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(command, preexec_fn=die_with_parent())
        if stopping.is_set():  # a signal while it started went to the child before it
            child.send_signal(signal.SIGTERM)
        code = child.wait()
        release_cache(args.run_id)  # the model files of a child killed before its end
        if stopping.is_set():
            return exit_status(code)
        if (marker := Aborted.read(store, keys.aborted(), optional=True)) is not None:
            if code == 0:  # it stopped on the marker: the task fails with the run
                log.error("%s stopped: the run was aborted (%s)", args.name, marker.describe())
                return EXIT_RUN_ABORTED
            log.error("%s exited with %d after the run was aborted (%s): not restarted",
                      args.name, code, marker.describe())
            return exit_status(code)
        if code == 0:
            return 0
        if code == EXIT_STORE_UNAVAILABLE:
            try:  # the stage waited the store's retry deadline: restart only if it is back
                store.exists(keys.run_json())
            except StoreUnavailable as exc:
                log.error("object store still unavailable (%s): not restarting %s", exc,
                          args.name)
                return EXIT_STORE_UNAVAILABLE
        if restarts >= limit or code == EXIT_CONFIG:  # the same config fails the same way
            reason = ("the run's config is invalid; see its log" if code == EXIT_CONFIG else
                      f"out of restarts (pipeline.max_restarts = {limit}); see its log")
            marker = Aborted(stage=args.name, worker=args.worker, exit_code=exit_status(code),
                             restarts=restarts, reason=reason, time=time.time())
            marker = marker.write_first(store, keys.aborted())
            log.error("%s failed %d times (exit %d); run aborted: %s", args.name, restarts + 1,
                      code, marker.describe())
            return exit_status(code)
        delay = restart_delay(restarts)
        restarts += 1
        log.warning("%s exited with %d after %.1f s; restarting in %g s (%d/%d)", args.name,
                    code, time.monotonic() - started, delay, restarts, limit)
        if stopping.wait(delay):
            return exit_status(code)
