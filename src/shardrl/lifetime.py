"""Child processes that must not outlive their parent (Linux: the kernel kills them), and
whether a process is still running."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _tied_to(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies; whether the parent is
    still `parent` after that (it may have died before the call)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def die_with_parent() -> Callable[[], None] | None:
    """A function for a new child to call first (a `preexec_fn`, or right after `fork`) that
    has the kernel SIGKILL it when the calling process dies; None elsewhere than Linux.

    Made in the parent: it remembers the parent's pid, so a child whose parent died before
    the call exits at once. A SIGKILLed runner then leaves no stage behind to race the stages
    of `--resume`, and a crashed learner no commit writer to race its restart."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def hook() -> None:
        if not _tied_to(parent):  # the parent died before the call
            os._exit(1)

    return hook


def die_with_launcher() -> None:
    """Under `torchrun`, have the kernel SIGKILL this rank when its launcher dies; nothing
    elsewhere. A process's first call, before anything that takes time.

    The elastic agent starts each rank in a session of its own, so the signals and the
    die-with-parent that reach `torchrun` (the local runner's SIGKILL, Ctrl-C) stop there: a
    rank whose launcher was killed went on running and could race the ranks of the restarted
    learner. A rank whose launcher died before this call (its parent is then init) exits."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if not _tied_to(parent) or parent == 1:
        print("this rank's launcher (torchrun) has exited: stopping", file=sys.stderr, flush=True)
        os._exit(1)


def running(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True


def process_identity(pid: int) -> str | None:
    """What tells process `pid` from a later process given the same pid: the boot's id and
    the process's start time since boot (Linux `/proc`); None where that cannot be read
    (no such process, or no `/proc`)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the fields after the command's name (which may hold spaces and parentheses); the
    # start time is the 22nd field of the line, the 20th after the name
    fields = stat[stat.rfind(")") + 2:].split()
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def still_running(pid: int, identity: str | None) -> bool:
    """Whether process `pid` is running and is the process whose `process_identity` was
    `identity` (None: not recorded, so any process with that pid counts)."""
    if not running(pid):
        return False
    if identity is None:
        return True
    now = process_identity(pid)
    return now is None or now == identity
