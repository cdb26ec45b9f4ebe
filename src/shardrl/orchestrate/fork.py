"""Starting stages by forking the runner (`pipeline.local.fork`).

A fresh interpreter per stage imports torch, transformers and the stage's modules again,
about 4-5 s of CPU each; on a small machine five stages starting together pay that on shared
cores before the first step. The runner instead imports the stage modules once (`warm`),
before any stage starts, and forks a child per stage replica. Each child takes its own
process group (in the runner's session: see `LocalRun.start`), log file, environment and
CPU affinity, names itself `stage:NAME`
(`/proc/PID/comm`), and runs the same `shardrl stage ...` command line in-process.

Forking is safe here because the runner runs torch operations only on one thread (so it
has no OpenMP pool for a child to inherit: `warmup`) and starts no threads of its own
before it forks: `warm` turns off tqdm's monitor thread and checks that the warm-up left no
thread behind. CPython takes the import lock around `fork`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ..redact import redacted

STAGE_MODULES = ("shardrl.stages", "shardrl.stages.snapshot", "shardrl.stages.rollout",
                 "shardrl.stages.score", "shardrl.stages.prepare", "shardrl.stages.learn",
                 "shardrl.stages.evaluate", "shardrl.stages.promote",
                 "shardrl.tasks.rewards")  # the verifiers: a rollout worker's scoring inline

_PR_SET_NAME = 15


def warm(cfg) -> None:
    """Import what the stages import, once, in the runner; pay the libraries' first-call
    costs (`orchestrate.warmup`) and build the run's task (`cfg`'s) for every stage too."""
    import torch
    import tqdm

    tqdm.tqdm.monitor_interval = 0  # no monitor thread in a process that forks
    if torch.version.cuda is None and torch.version.hip is None:
        # a CPU-only torch (asked without a CUDA query, which would initialise the driver in
        # a process that then forks): transformers imports DeepSpeed where it is installed,
        # and told the accelerator it does not warn in every run's output that it found none
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in STAGE_MODULES:
        importlib.import_module(name)
    from ..stages.context import warm_up

    warm_up()  # the libraries' lazy loads too, once for every stage
    from .warmup import exercise, new_threads, threads

    before = threads()
    exercise()  # and their first-call costs (loading, sampling, a step), on one thread
    if extra := new_threads(before):
        raise RuntimeError("warming the libraries up left threads running in the runner, which "
                           f"forks: {', '.join(extra)}")
    from ..tasks.source import make_task

    make_task(cfg)
    gc.freeze()  # children inherit them: no full collection scans them, nor copies their pages


def process_title(name: str) -> str:
    """The `comm` of a forked stage: `stage:NAME`, at most 15 bytes."""
    return f"stage:{name}"[:15]


class Forked:
    """A forked stage: the part of `subprocess.Popen` the runner uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.cpu_s: float | None = None
        """User + system CPU seconds of the child (and its reaped children), once it exited."""

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_s = usage.ru_utime + usage.ru_stime
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code


def fork_stage(argv: list[str], log: Path, env: dict[str, str], name: str,
               child_setup: Callable[[], None]) -> Forked:
    """Run `shardrl ARGV...` in a forked child writing to `log`; `child_setup` runs in the
    child before the stage (death signal, affinity, niceness)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write the runner's buffered output again
    pid = os.fork()
    if pid:
        return Forked(pid, argv)
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, in the runner's session (`LocalRun.start`)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        fd = os.open(os.devnull, os.O_RDONLY)  # a read of the runner's terminal would stop it
        os.dup2(fd, 0)
        os.close(fd)
        child_setup()  # after the redirects, as a subprocess's: what it says goes to the log
        os.environ.update(env)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(_PR_SET_NAME, process_title(name).encode(), 0, 0, 0)
        from ..cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports and exits, whatever happened
        # credentials in it masked, as a subprocess's excepthook does (`redact`)
        sys.stderr.write(redacted(traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
