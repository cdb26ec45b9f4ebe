"""Run untrusted reward code in a limited subprocess.

Each call starts `python -I -B` (isolated: no PYTHON* variables, no user site, no bytecode
written) in a fresh
temporary working directory with stdin from /dev/null and a minimal environment (PATH,
LANG, HOME and TMPDIR pointing at the working directory): credentials in the parent's
environment (AWS_*, SHARDRL_*, MLFLOW_*, ...) are not handed to it. Before any untrusted code
runs, the child limits itself with RLIMIT_CPU, RLIMIT_AS (address space), RLIMIT_FSIZE
(bytes written to any file, stdout included; a snippet may write at most `MAX_FILES_WRITTEN`
files, and no database), RLIMIT_NOFILE (open files) and RLIMIT_CORE=0;
the parent enforces the wall-clock limit and kills the child's whole process group, also
when the call is stopped; the kernel kills the child if the parent dies (PR_SET_PDEATHSIG).
The result comes back as JSON over a private pipe, read as it comes (at most `output_bytes`);
stdout and stderr through files the parent holds open, never by a name in the child's folder.
Failures never raise here: they come back as an error string, "timeout", "memory" or
"crashed: ...".

Since those limits hold per process, the child may not start another one, and since it runs
as the scoring process's user, it must not touch that user's other processes or files. So
before any untrusted code runs the child drops every capability (a child of root keeps
none) and puts up two walls the kernel enforces, each where the kernel offers it (the
result names in `walls` what was applied: "capabilities", "landlock", "seccomp"; a missing
one is logged once per process):
- a seccomp filter: no fork, exec or `clone` of a process (threads are allowed, in no new
  namespace), no socket but a connected pair of stream sockets, no ptrace or access to
  another process's memory; no signal to another process (`kill`, by process descriptor, or
  as the owner of a file's I/O), no change to another process's limits, scheduling or
  priority; no change to any file's mode, owner, times or attributes, no truncation by
  name, no ioctl but the interpreter's own (a terminal's settings and size, bytes waiting,
  blocking, close-on-exec), no System V or POSIX IPC, no file leases, inotify or fanotify
  watches; no io_uring, namespaces, keys, or lifting the death signal set below; and
  system calls newer than its table answer ENOSYS;
- Landlock: of the file system the child reads only the interpreter, the system's
  libraries (/lib, /usr/lib, /usr/local/lib, time zones), a few harmless files of /etc and
  the import path, less the scoring process's working folder and any folder above it (in a
  call, its target's own module or package is read there, loaded from its file or
  folders), and writes only the call's own folder, where it makes no
  device node; the parent's `/proc/<pid>/environ` and the user's home are out of reach.
  From Linux 6.7 no TCP, from 6.12 no signal or abstract socket beyond the child.
An audit hook inside the interpreter refuses processes, programs and `os.kill` to other
processes first, with a clearer error (a sandboxed verifier that must run a program runs
unsandboxed, under limits of its own); a snippet (`run_python_snippet`, model output) may
not load native code either (`ctypes`, `_posixsubprocess`). Without the walls (another
kernel, or a container that refuses their calls) that guard is all there is, and native
code can go around it: the child can then read and write what the user can, and reach the
user's other processes.

Code that a verifier executes in its own process can forge that process's result;
`run_python_snippet` avoids this by judging only the snippet's stdout in the parent.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_ERROR_CHARS = 500
MAX_FILES_WRITTEN = 64
"""Files a snippet may write, by name (each at most `output_bytes`)."""

# Runs in the child. argv: request file, result pipe fd. Limits first, then the work. Nothing
# the guard reads is left where the untrusted code could reach it by name (`import __main__`
# gives this module): the guard's settings are immutable values bound into it in a function
# whose frame is gone before the code runs.
_BOOTSTRAP = r"""
import json, os, resource, sys

def _start():
    with open(sys.argv[1]) as fh:
        req = json.load(fh)
    os.unlink(sys.argv[1])
    # killed with the parent (SIGKILL, or the parent stopped mid-call): never left running
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != req["parent"]:  # the parent died first
        os._exit(1)
    cpu = req["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (req["memory_bytes"], req["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (req["output_bytes"], req["output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (req["open_files"], req["open_files"]))
    req["walls"] = _walls(req, ctypes)
    # ctypes is then forgotten, so that a snippet importing it loads it anew (refused below)
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    _guard(req["mode"] == "snippet")
    return req, int(sys.argv[2])

def _walls(req, ctypes):
    # Limits the kernel enforces, out of reach of anything the code does in Python or in
    # native code: no capabilities (a child of root keeps none), Landlock (the file system:
    # read the interpreter, its libraries and the import path, write only the call's
    # folder; no TCP; no signal or abstract socket beyond this process) and a seccomp
    # filter (no new process or program, no socket, no hold on another process). Each is
    # applied where the kernel offers it; the names of those applied go back with the result.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    class CapHeader(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    no_caps = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
    libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), no_caps)  # version 3
    with open("/proc/self/status") as fh:  # what it holds now, whatever capset answered
        held = [ln.split()[1] for ln in fh if ln.startswith(("CapEff:", "CapPrm:"))]
    applied = ["capabilities"] if held and all(int(c, 16) == 0 for c in held) else []
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: required by both walls
        return applied
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(.., VERSION)
    if abi >= 1 and _landlock(req, ctypes, libc, abi):
        applied.append("landlock")
    if _seccomp(req, ctypes, libc):
        applied.append("seccomp")
    return applied

def _landlock(req, ctypes, libc, abi):
    every = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (
        1 << 15 if abi >= 5 else 0)
    read_file, read_dir, write_file = 1 << 2, 1 << 3, 1 << 1
    truncate = 1 << 14 if abi >= 3 else 0
    devices = 1 << 6 | 1 << 11  # character and block device nodes: never made
    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                    ("scoped", ctypes.c_uint64)]
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("access", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    ruleset = Ruleset(every, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    rules = libc.syscall(444, ctypes.byref(ruleset), size, 0)
    if rules < 0:
        return False
    try:
        # the interpreter, its import path and the system's libraries, but never the
        # scoring process's working folder nor one above it (`python -m`, a notebook or a
        # `.pth` may name the project's root, which holds anything: a call's target there
        # is granted by itself, in `read_paths`)
        cwd = req["cwd"]
        reads = {os.path.realpath(p) for p in [
            *sys.path, *req["sys_path"], *req["read_paths"], sys.prefix, sys.base_prefix, sys.exec_prefix,
            sys.base_exec_prefix, "/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
            "/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime", "/etc/passwd",
            "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf",
            "/etc/mime.types", "/etc/os-release", "/etc/ssl", "/dev/urandom", "/proc/cpuinfo",
            "/proc/meminfo", "/sys/devices/system/cpu", "/proc/self/stat", "/proc/self/statm",
            "/proc/self/status", "/proc/self/fd"] if p}
        grants = [(p, read_file | read_dir) for p in sorted(reads)
                  if p != cwd and not cwd.startswith(p.rstrip("/") + "/")] + [
            ("/dev/null", read_file | write_file | truncate), (os.getcwd(), every & ~devices)]
        for path, access in grants:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                added = -1
                continue
            try:
                if not os.path.isdir(path):
                    access &= ~read_dir
                added = libc.syscall(445, rules, 1, ctypes.byref(Beneath(access, fd)), 0) \
                    if access else 0
            finally:
                os.close(fd)
        # the call's own folder last: without it the code could write nowhere
        return added == 0 and libc.syscall(446, rules, 0) == 0
    finally:
        os.close(rules)

def _seccomp(req, ctypes, libc):
    # per machine: (audit arch, {name: number}); names outside the table are allowed
    arch, nr = {
        "x86_64": (0xC000003E, dict(
            clone=56, clone3=435, kill=62, tgkill=234, prlimit64=302, sched_setparam=142,
            sched_setscheduler=144, sched_setaffinity=203, sched_setattr=314, fcntl=72,
            ioctl=16, prctl=157, setpriority=141, socketpair=53,
            fork=57, vfork=58, execve=59, execveat=322, ptrace=101, process_vm_readv=310,
            process_vm_writev=311, socket=41, tkill=200, rt_sigqueueinfo=129,
            rt_tgsigqueueinfo=297, pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438,
            io_uring_setup=425, io_uring_enter=426, io_uring_register=427, unshare=272,
            setns=308, mount=165, bpf=321, perf_event_open=298, userfaultfd=323, add_key=248,
            request_key=249, keyctl=250, personality=135, ioprio_set=251, migrate_pages=256,
            move_pages=279, kcmp=312, process_madvise=440, syslog=103, get_robust_list=274,
            # metadata of files Landlock lets it read or not see: modes, owners, times,
            # attributes; and truncating by name (Landlock refuses it only from Linux 6.2)
            chmod=90, fchmod=91, fchmodat=268, fchmodat2=452, chown=92, fchown=93,
            lchown=94, fchownat=260, utime=132, utimes=235, futimesat=261, utimensat=280,
            setxattr=188, lsetxattr=189, fsetxattr=190, removexattr=197, lremovexattr=198,
            fremovexattr=199, setxattrat=463, removexattrat=466, truncate=76,
            # System V and POSIX IPC: other processes' shared memory, queues and
            # semaphores, and memory that outlives the child
            shmget=29, shmat=30, shmctl=31, shmdt=67, semget=64, semop=65, semctl=66,
            semtimedop=220, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240,
            mq_unlink=241, mq_timedsend=242, mq_timedreceive=243, mq_notify=244,
            mq_getsetattr=245, inotify_add_watch=254, fanotify_init=300, fanotify_mark=301,
            file_setattr=469)),
        "aarch64": (0xC00000B7, dict(
            clone=220, clone3=435, kill=129, tgkill=131, prlimit64=261, sched_setparam=118,
            sched_setscheduler=119, sched_setaffinity=122, sched_setattr=274, fcntl=25,
            ioctl=29, prctl=167, setpriority=140, socketpair=199,
            execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271,
            socket=198, tkill=130, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240,
            pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438, io_uring_setup=425,
            io_uring_enter=426, io_uring_register=427, unshare=97, setns=268, mount=40,
            bpf=280, perf_event_open=241, userfaultfd=282, add_key=217, request_key=218,
            keyctl=219, personality=92, ioprio_set=30, migrate_pages=238, move_pages=239,
            kcmp=272, process_madvise=440, syslog=116, get_robust_list=100,
            fchmod=52, fchmodat=53, fchmodat2=452, fchownat=54, fchown=55, utimensat=88,
            setxattr=5, lsetxattr=6, fsetxattr=7, removexattr=14, lremovexattr=15,
            fremovexattr=16, setxattrat=463, removexattrat=466, truncate=45,
            mq_open=180, mq_unlink=181, mq_timedsend=182, mq_timedreceive=183,
            mq_notify=184, mq_getsetattr=185, msgget=186, msgctl=187, msgrcv=188, msgsnd=189,
            semget=190, semctl=191, semtimedop=192, semop=193, shmget=194, shmctl=195,
            shmat=196, shmdt=197, inotify_add_watch=27, fanotify_init=262, fanotify_mark=263,
            file_setattr=469)),
    }.get(os.uname().machine, (None, None))
    if arch is None:
        return False
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    own, special = os.getpid(), {"clone", "clone3", "kill", "tgkill", "prlimit64", "fcntl",
                                 "ioctl", "prctl", "setpriority", "socketpair"} | {
        n for n in nr if n.startswith("sched_")}

    def arg(i):  # the low 32 bits of argument i (little-endian)
        return (ld, 0, 0, 16 + 8 * i)

    def pick(values, hit, miss):  # with an argument loaded: `hit` if one of `values`
        n = len(values)
        return [*[(jeq, n - k, 0, v & 0xFFFFFFFF) for k, v in enumerate(values)],
                (ret, 0, 0, miss), (ret, 0, 0, hit)]

    def when(name, body):  # `body` for this call; past it, with the number still loaded
        return [(jeq, 0, len(body), nr[name]), *body]

    def only(name, i, values):  # allowed when argument i is one of `values`
        return when(name, [arg(i), *pick(values, allow, eperm)])

    def never(name, i, values):  # refused when argument i is one of `values`
        return when(name, [arg(i), *pick(values, eperm, allow)])

    def both(name, i, first, j, values, mask=None):  # argument i is `first`, j one of `values`
        tail = [*([(0x54, 0, 0, mask)] if mask else []), *pick(values, allow, eperm)]  # j & mask
        return when(name, [arg(i), (jeq, 0, len(tail) - 1, first), arg(j), *tail])

    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, 0x80000000),  # another ABI: killed
            (ld, 0, 0, 0)]
    if arch == 0xC000003E:  # the x32 ABI's numbers
        prog += [(0x35, 0, 1, 0x40000000), (ret, 0, 0, eperm)]
    for name in sorted(set(nr) - special):
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, nr["clone3"]), (ret, 0, 0, enosys),  # the C library falls back to clone
             # calls newer than this table (from 470 on): unknown, so not there
             (0x35, 0, 1, 470), (ret, 0, 0, enosys)]
    # each block returns once its syscall matched, and leaves the number loaded otherwise
    blocks = [
        only("kill", 0, [own, -own, 0]),  # this process, its own group (its session's), or 0
        only("tgkill", 0, [own]),  # a thread of this process
        *[only(name, 0, [0, own]) for name in sorted(special) if name.startswith("sched_")],
        only("prlimit64", 0, [0, own]),  # its own limits only
        # its own priority only (PRIO_PROCESS): os.nice
        both("setpriority", 0, 0, 1, [0, own]),
        # a connected pair of stream sockets (asyncio's wake-up pipe), which can address
        # nothing: AF_UNIX, SOCK_STREAM
        both("socketpair", 0, 1, 1, [1], mask=0xF),
        # F_SETOWN(_EX): a signal to another process on I/O; F_SETLEASE: other processes'
        # opens of the file held up
        never("fcntl", 1, [8, 15, 1024]),
        # ioctl: what the interpreter asks of a file (a terminal's settings and size, bytes
        # waiting, blocking, close-on-exec), never a file's flags or attributes
        only("ioctl", 1, [0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451]),
        # PR_SET_PDEATHSIG: it dies with its parent; PR_SCHED_CORE: other processes' cores
        never("prctl", 0, [1, 62]),
        # clone: a thread (CLONE_THREAD) in no new namespace, never a process
        when("clone", [arg(0), (jset, 1, 0, 0x7E020080), (jset, 1, 0, 0x10000),
                       (ret, 0, 0, eperm), (ret, 0, 0, allow)]),
    ]
    for block in blocks:
        prog += block
    prog += [(ret, 0, 0, allow)]

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                    ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    insns = (Insn * len(prog))(*[Insn(*i) for i in prog])
    fprog = Prog(len(prog), insns)
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER

def _guard(snippet):
    # the limits hold per process: no new process, no exec, no signal to another process
    # (and for a snippet, no native calls, no raw fork_exec and no walking the heap to this
    # hook), so nothing outgrows them
    blocked = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
               "subprocess.Popen"}
    native = frozenset()
    if snippet:
        blocked |= {"ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function",
                    "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
        # (and no databases, whose files are written by native code, unseen by the count of
        # files written below)
        native = frozenset(("_posixsubprocess", "_ctypes", "posix", "_signal", "_sqlite3",
                            "_dbm", "_gdbm"))
        # a signal by process file descriptor raises no audit event: those calls are
        # replaced, and their modules cannot be imported afresh. Python-level only: a
        # snippet that reaches the interpreter's internals gets past it (the README says so)
        import posix, signal, _signal
        def refused(*args, **kwargs):
            raise PermissionError("not allowed in the sandbox: pidfd")
        for mod, name in ((os, "pidfd_open"), (posix, "pidfd_open"),
                          (signal, "pidfd_send_signal"), (_signal, "pidfd_send_signal")):
            if hasattr(mod, name):
                setattr(mod, name, refused)
    blocked, own = frozenset(blocked), os.getpid()
    # RLIMIT_FSIZE bounds each file: a snippet may write few files (by name: those it opens
    # for writing, and those it renames or links files to), so that its writes stay bounded
    # in all
    writing, names = (os.O_WRONLY | os.O_RDWR) if snippet else 0, set()
    def guard(event, args):
        if event in blocked or (event in ("os.kill", "os.killpg") and args[0] not in (own, 0)) or (
                event == "import" and args[0] in native):
            raise PermissionError("not allowed in the sandbox: " + event
                                  + (" " + str(args[0]) if event == "import" else ""))
        if snippet and ((event == "open" and args[2] & writing and not isinstance(args[0], int))
                        or event in ("os.rename", "os.link")):
            name = args[0] if event == "open" else args[1]
            try:
                name = os.path.abspath(os.fsdecode(name))
            except Exception:
                name = repr(name)
            if name not in names and len(names) >= %(max_files)d:
                raise PermissionError("not allowed in the sandbox: writing more than "
                                      "%(max_files)d files")
            names.add(name)
    sys.addaudithook(guard)

def _main(req, fd):
    def report(msg):
        os.write(fd, json.dumps(msg).encode())
    sys.path[:0] = req["sys_path"]
    try:
        if req["mode"] == "snippet":
            try:
                exec(compile(req["code"], "<snippet>", "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
            value = None
        else:
            import importlib
            import importlib.machinery
            import importlib.util
            module, _, attr = req["target"].partition(":")
            if req["top"]:  # from its file: its folder need not be listed
                name, origin, folders = req["top"]
                if origin is None:  # a namespace package: its folders are its path
                    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                    spec.submodule_search_locations = folders
                else:
                    spec = importlib.util.spec_from_file_location(
                        name, origin, submodule_search_locations=folders)
                sys.modules[name] = importlib.util.module_from_spec(spec)
                if spec.loader is not None:
                    spec.loader.exec_module(sys.modules[name])
            fn = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
            value = fn(*req["args"])
        sys.stdout.flush()
        report({"value": value, "walls": req["walls"]})
    except MemoryError:
        report({"error": "memory", "walls": req["walls"]})
    except BaseException as exc:
        report({"error": ("crashed: %s: %s" % (type(exc).__name__, exc))[:%(max_error)d],
                "walls": req["walls"]})

_request = _start()
del _start, _guard, _walls, _landlock, _seccomp
_main(*_request)
""".replace("%(max_error)d", str(MAX_ERROR_CHARS)).replace("%(max_files)d",
                                                            str(MAX_FILES_WRITTEN))


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits (defaults match the run config's `reward.sandbox`)."""

    cpu_seconds: float = 2.0
    memory_mb: int = 512
    wall_seconds: float = 5.0
    output_bytes: int = 1 << 20
    open_files: int = 256


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed call produced: a JSON value, the captured stdout, or an error."""

    value: Any = None
    stdout: str = ""
    error: str | None = None
    walls: tuple[str, ...] = ()
    """The limits the kernel holds the child to (`WALLS`: "capabilities", "landlock",
    "seccomp") that it applied, when it reported them."""


class SandboxError(RuntimeError):
    """A sandboxed verifier failed; the message is the error string itself ("timeout", ...)."""


def clean_env(workdir: str) -> dict[str, str]:
    """The child's whole environment: nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
    }


def _parent_sys_path() -> list[str]:
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


def _import_roots(target: str) -> tuple[list[str], list | None]:
    """(what a sandboxed call may read besides the interpreter and the import path, how to
    load its target's top-level module): the packages installed in editable mode, and the
    target's own module or package, which the child loads from its file (`[name, file,
    package folders or None]`), so that nothing else of the folder it lies in need be
    readable or listed (the child leaves the parent's working folder out of its import
    path's grants). Found without importing the target."""
    reads: list[str] = []
    for finder in sys.meta_path:  # setuptools' editable installs: package name -> folder
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", "")), "MAPPING", None)
        if isinstance(mapping, dict):
            reads += [p for p in mapping.values() if isinstance(p, str)]
    name = target.partition(":")[0].partition(".")[0]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) or None if spec else None
    if spec is None or not (folders or spec.origin and os.path.isabs(spec.origin)):
        return reads, None  # not found (the child says so), or built in
    origin = spec.origin if spec.origin and os.path.isabs(spec.origin) else None  # namespace
    return reads + (folders or [origin]), [name, origin, folders]


WALLS = ("capabilities", "landlock", "seccomp")
_unwalled: set[str] = set()


def _note_walls(walls: tuple[str, ...]) -> None:
    """Warn once per process for each wall the kernel did not give a child."""
    for wall in WALLS:
        if wall not in walls and wall not in _unwalled:
            _unwalled.add(wall)
            logging.getLogger("shardrl.sandbox").warning(
                "sandbox: %s", _MISSING[wall])


_MISSING = {
    "capabilities": "the sandbox's child could not drop its capabilities: as root it may "
                    "change any file's owner and mode",
    "landlock": "no Landlock in this kernel (or it is refused here): sandboxed code can read "
                "and write what this user can, and connect over TCP",
    "seccomp": "no seccomp filter could be installed: native code in the sandbox can start "
               "processes and open sockets past the Python-level guard",
}


def _read_available(fd: int, chunks: list[bytes]) -> int | None:
    """Append what the pipe holds now to `chunks` (never blocks on a stray writer); the
    number of bytes read, or None at the end of the pipe (every writer closed it)."""
    os.set_blocking(fd, False)
    read = 0
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            read += len(chunk)
    except BlockingIOError:
        return read
    return None if read == 0 else read


def _reap(proc: subprocess.Popen, cpu: list[float]) -> bool:
    """Whether the child has exited; reaped here, with the CPU seconds it used appended to
    `cpu` (what tells the hard CPU limit's SIGKILL from another one)."""
    if proc.returncode is not None:
        return True
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return False
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu.append(usage.ru_utime + usage.ru_stime)
    return True


def _collect(proc: subprocess.Popen, fd: int, wall_seconds: float,
             cap: int, cpu: list[float]) -> tuple[bytes, str | None]:
    """Read the result pipe while the child runs, until it exits, the wall-clock limit or
    `cap` bytes: a result larger than the pipe's buffer would otherwise block the child
    until the limit. (result bytes, None or "timeout" or the too-large error); the child's
    CPU seconds go to `cpu` if it exited."""
    deadline = time.monotonic() + wall_seconds
    chunks: list[bytes] = []
    size, open_pipe = 0, True
    try:
        exited = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (before Linux 5.3): poll for the exit
        exited = None
    try:
        while not _reap(proc, cpu):
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), "timeout"
            # a pipe the child closed stays readable: watched no more, it would spin here
            watched = ([fd] if open_pipe else []) + ([] if exited is None else [exited])
            ready, _, _ = select.select(watched, [], [], left if exited is not None
                                        else min(left, 0.01))
            if fd in ready:
                read = _read_available(fd, chunks)
                open_pipe = read is not None
                size += read or 0
                if size > cap:
                    return b"", f"crashed: result over {cap} bytes"
    finally:
        if exited is not None:
            os.close(exited)
    size += _read_available(fd, chunks) or 0
    if size > cap:
        return b"", f"crashed: result over {cap} bytes"
    return b"".join(chunks), None


def _classify(returncode: int, message: dict | None, stderr: str, snippet: bool,
              cpu_s: float | None = None, cpu_limit: float = 0.0) -> str | None:
    """The error string for a finished child, or None if it succeeded. `cpu_s`: the CPU
    seconds it used, when known; `cpu_limit`: its CPU limit in seconds."""
    if message is not None:
        return message.get("error")
    if returncode == -signal.SIGXCPU:  # the soft CPU limit
        return "timeout"
    if returncode == -signal.SIGKILL:
        if cpu_s is None or cpu_s >= cpu_limit:  # the hard CPU limit (SIGXCPU ignored)
            return "timeout"
        return (f"crashed: killed (SIGKILL) after {cpu_s:.2f} s of CPU, under its limit: the "
                "system's out-of-memory killer, or another process")
    if returncode < 0:
        return f"crashed: signal {signal.Signals(-returncode).name}"
    if returncode == 0 and snippet:  # e.g. os._exit(0) after printing: a normal end
        return None
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    detail = lines[-1] if lines else "no result"
    return f"crashed: exit code {returncode}: {detail}"[:MAX_ERROR_CHARS]


def _run(request: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    try:
        return _run_child(request, limits)
    except OSError as exc:  # no process or scratch folder to be had (EAGAIN, ENOSPC, ...)
        return SandboxResult(error=f"crashed: the sandbox did not start: {exc}"[:MAX_ERROR_CHARS])


def _run_child(request: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    snippet = request["mode"] == "snippet"
    request = {
        **request,
        "parent": os.getpid(),
        "cwd": os.path.realpath(os.getcwd()),
        "cpu_seconds": max(1, math.ceil(limits.cpu_seconds)),  # RLIMIT_CPU counts whole seconds
        "memory_bytes": limits.memory_mb * 1024 * 1024,
        "output_bytes": limits.output_bytes,
        "open_files": limits.open_files,
    }
    with (
        tempfile.TemporaryDirectory(prefix="shardrl-sandbox-", ignore_cleanup_errors=True) as work,
        # the child's stdout and stderr are read back through these descriptors, never by
        # name: the folder is the child's, which may put a FIFO or a link in their place
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        req_path = Path(work) / "request.json"
        req_path.write_text(json.dumps(request))
        read_fd, write_fd = os.pipe()
        proc = None
        try:
            proc = subprocess.Popen(
                # -B: no bytecode written for the modules the code imports
                [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(req_path), str(write_fd)],
                cwd=work,
                env=clean_env(work),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
            os.close(write_fd)
            write_fd = -1
            cpu: list[float] = []
            raw, stopped = _collect(proc, read_fd, limits.wall_seconds, limits.output_bytes, cpu)
        finally:  # also when this call is stopped (a signal, an error): the child goes too
            if proc is not None:
                try:  # the whole group: nothing the child started outlives the call
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        out.seek(0)
        stdout = out.read(limits.output_bytes)
        err.seek(max(0, os.fstat(err.fileno()).st_size - 4096))
        stderr = err.read(4096).decode(errors="replace")
    text = stdout.decode(errors="replace")
    if stopped is not None:
        return SandboxResult(stdout=text, error=stopped)
    try:
        message = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        message = {"error": "crashed: unreadable result"}
    error = _classify(proc.returncode, message, stderr, snippet, cpu[0] if cpu else None,
                      request["cpu_seconds"])
    walls = message.get("walls") if isinstance(message, dict) else None
    walls = tuple(w for w in walls if w in WALLS) if isinstance(walls, list) else ()
    if message is not None:
        _note_walls(walls)
    if error is not None:
        return SandboxResult(stdout=text, error=error, walls=walls)
    return SandboxResult(value=message.get("value") if message else None, stdout=text,
                         walls=walls)


def run_sandboxed_call(target: str, args: list[Any], limits: SandboxLimits) -> SandboxResult:
    """Call `package.module:function(*args)` in the sandbox; args and result go as JSON.

    The child sees the parent's `sys.path`, so whatever the parent can import it can too,
    but from the parent's working folder only the target's own module or package
    (`_import_roots`).
    """
    reads, top = _import_roots(target)
    return _run({"mode": "call", "target": target, "args": args, "sys_path": _parent_sys_path(),
                 "read_paths": reads, "top": top}, limits)


def run_python_snippet(code: str, limits: SandboxLimits) -> SandboxResult:
    """Execute Python source as `__main__` in the sandbox and capture its stdout."""
    return _run({"mode": "snippet", "code": code, "sys_path": [], "read_paths": []}, limits)


def sandboxed_verifier(dotted_path: str, limits: SandboxLimits):
    """A verifier `(response, answer) -> float` that runs `dotted_path` in the sandbox.

    A failure raises `SandboxError(error)`; `verifiers.run_verifier` turns it into reward 0.0.
    """

    def verifier(response: str, answer: str) -> float:
        result = run_sandboxed_call(dotted_path, [response, answer], limits)
        if result.error is not None:
            raise SandboxError(result.error)
        return result.value

    verifier.__name__ = f"sandboxed[{dotted_path}]"
    return verifier


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of a response, or the whole response if there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def python_exec_verifier(limits: SandboxLimits):
    """A verifier that runs the response's Python code and compares its stdout to the answer.

    Reward 1.0 when the stripped stdout equals the stripped answer, else 0.0; a snippet
    that fails raises `SandboxError` ("timeout", "memory", "crashed: ...").
    """

    def python_exec(response: str, answer: str) -> float:
        result = run_python_snippet(extract_code(response), limits)
        if result.error is not None:
            raise SandboxError(result.error)
        return 1.0 if result.stdout.strip() == answer.strip() else 0.0

    return python_exec
