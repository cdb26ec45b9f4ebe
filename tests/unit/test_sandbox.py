"""Sandbox: limits hold, failures come back as errors, the environment stays clean."""

from __future__ import annotations

import os
import resource
import sys
import time

import pytest

from procs import alive, children
from shardrl.tasks.rewards import (
    RewardSpec,
    VerifierTerm,
    build_verifiers,
    error_count,
    score_batch,
)
from shardrl.tasks.sandbox import (
    SandboxLimits,
    SandboxResult,
    extract_code,
    run_python_snippet,
    run_sandboxed_call,
    sandboxed_verifier,
)
from shardrl.tasks.verifiers import get_verifier, run_verifier

REWARD_CODE = """
import os, sys, time

def good(response, answer):
    return 1.0 if response.strip() == answer else 0.0

def spin(response, answer):
    while True:
        pass

def sleep(response, answer):
    time.sleep(60)

def hog(response, answer):
    return float(len(bytearray(4 * 1024**3)))

def crash(response, answer):
    raise ValueError("boom")

def abort(response, answer):
    os.abort()

def big(response, answer):
    return "x" * 300_000

def huge(response, answer):
    return "x" * 5_000_000

def run_program(response, answer):
    import subprocess
    return float(subprocess.run(["true"]).returncode)

def signal_parent(response, answer):
    import signal
    os.kill(os.getppid(), signal.SIGTERM)
    return 1.0

def signal_self(response, answer):
    os.kill(os.getpid(), 0)  # a probe of its own process: allowed
    return 1.0

def keep_running_after_the_parent():
    import ctypes
    return float(ctypes.CDLL(None).prctl(1, 0, 0, 0, 0))  # PR_SET_PDEATHSIG 0: refused, -1

def system_v_memory():
    import ctypes
    libc = ctypes.CDLL(None)
    made = [libc.shmget(0, 1 << 20, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600)]
    for remove, ident in zip((libc.shmctl, libc.msgctl, libc.semctl), made):
        if ident >= 0:  # made after all: removed (IPC_RMID), so that no failed run leaves it
            remove(ident, 0, None)
    return made

def newer_than_the_filter():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    return [libc.syscall(470), ctypes.get_errno()]

def uses_the_project():
    from shardrl.tasks.sandbox import extract_code
    return float(extract_code("x") == "x")

def parent_environ():
    return open("/proc/%d/environ" % os.getppid(), "rb").read().decode(errors="replace")

def surroundings():
    return {"env": sorted(os.environ), "cwd": os.getcwd(), "stdin": sys.stdin.read()}
"""

LIMITS = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=4)


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "reward_fns.py").write_text(REWARD_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reward_fns"


def test_good_verifier_returns_one(reward_module):
    verifier = sandboxed_verifier(f"{reward_module}:good", LIMITS)
    assert run_verifier(verifier, " 42 ", "42") == (1.0, None)
    assert run_verifier(verifier, "41", "42") == (0.0, None)


def test_infinite_loop_times_out_within_the_wall_limit(reward_module):
    started = time.monotonic()
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=2)
    reward, error = run_verifier(sandboxed_verifier(f"{reward_module}:spin", limits), "", "")
    assert (reward, error) == (0.0, "timeout")
    # The CPU limit (1 s) or, on a busy machine, the wall limit (2 s) stops it; allow
    # start-up and kill time.
    assert time.monotonic() - started < limits.wall_seconds + 1.5


def test_sleeping_code_hits_the_wall_clock_limit(reward_module):
    limits = SandboxLimits(cpu_seconds=5, memory_mb=256, wall_seconds=1)
    started = time.monotonic()
    assert run_sandboxed_call(f"{reward_module}:sleep", ["", ""], limits).error == "timeout"
    assert time.monotonic() - started < 2.5


def test_huge_allocation_is_a_memory_error(reward_module):
    verifier = sandboxed_verifier(f"{reward_module}:hog", LIMITS)  # 4 GiB under a 256 MiB cap
    assert run_verifier(verifier, "", "") == (0.0, "memory")


def test_crashes_are_reported(reward_module):
    assert run_verifier(sandboxed_verifier(f"{reward_module}:crash", LIMITS), "", "") == (
        0.0,
        "crashed: ValueError: boom",
    )
    assert run_verifier(sandboxed_verifier(f"{reward_module}:abort", LIMITS), "", "") == (
        0.0,
        "crashed: signal SIGABRT",
    )


def test_credentials_do_not_reach_the_child(reward_module, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("SHARDRL_STORE_TOKEN", "secret")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
    result = run_sandboxed_call(f"{reward_module}:surroundings", [], LIMITS)
    assert result.error is None
    assert result.value["env"] == ["HOME", "LANG", "PATH", "TMPDIR"]
    assert "shardrl-sandbox-" in result.value["cwd"]  # its own temporary directory
    assert result.value["stdin"] == ""  # stdin is /dev/null


def test_a_result_larger_than_the_pipe_comes_back_at_once(reward_module):
    """The result was read only after the child's exit, so one over the pipe's 64 KiB buffer
    blocked the child until the wall-clock limit and came back as a timeout."""
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=20)
    started = time.monotonic()
    result = run_sandboxed_call(f"{reward_module}:big", ["", ""], limits)
    assert result.error is None and result.value == "x" * 300_000
    assert time.monotonic() - started < 10
    # over the output bound (1 MiB by default): an error, not an unbounded read
    result = run_sandboxed_call(f"{reward_module}:huge", ["", ""], limits)
    assert result.error == f"crashed: result over {1 << 20} bytes"


def test_a_sandboxed_verifier_module_is_not_imported_here(tmp_path, monkeypatch):
    """Its module's top-level code is as untrusted as its function: it runs in the child
    (which may not write beside it, so the module tells where it ran through its result)."""
    (tmp_path / "untrusted_reward.py").write_text(
        "import os\n"
        "LOADED_BY = os.getpid()\n"
        "def score(response, answer):\n"
        "    return float(LOADED_BY) if response == answer else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_verifier("untrusted_reward:score", sandboxed=True, limits=LIMITS)
    assert "untrusted_reward" not in sys.modules  # not imported by the parent
    loaded_by, error = run_verifier(fn, "a", "a")
    assert error is None and loaded_by not in (0.0, float(os.getpid()))  # the child did
    assert "untrusted_reward" not in sys.modules
    with pytest.raises(Exception, match="no module named 'no_such_reward'"):
        get_verifier("no_such_reward:score", sandboxed=True, limits=LIMITS)


def test_a_sandboxed_verifier_package_is_not_imported_here_either(tmp_path, monkeypatch):
    """`pkg.mod:fn`: finding `pkg.mod` must not run `pkg/__init__.py` in the scorer, where the
    credentials are."""
    package = tmp_path / "untrusted_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nLOADED_BY = os.getpid()\n")
    (package / "rules.py").write_text("from untrusted_pkg import LOADED_BY\n"
                                      "def score(response, answer):\n"
                                      "    return float(LOADED_BY) if response == answer else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_verifier("untrusted_pkg.rules:score", sandboxed=True, limits=LIMITS)
    assert "untrusted_pkg" not in sys.modules
    loaded_by, error = run_verifier(fn, "a", "a")
    assert error is None and loaded_by not in (0.0, float(os.getpid()))
    for missing in ("untrusted_pkg.nothing:score", "untrusted_pkg.rules.deeper:score"):
        with pytest.raises(Exception, match="cannot load verifier"):
            get_verifier(missing, sandboxed=True, limits=LIMITS)
    assert "untrusted_pkg" not in sys.modules


def test_python_exec_compares_stdout_and_stays_sandboxed():
    python_exec = get_verifier("python_exec", limits=LIMITS)
    response = "Here is the code:\n```python\nprint(sum(range(10)))\n```\nDone."
    assert run_verifier(python_exec, response, "45") == (1.0, None)  # 0+1+...+9 = 45
    assert run_verifier(python_exec, "print(44)", "45") == (0.0, None)
    assert run_verifier(python_exec, "x = bytearray(10**10)", "45") == (0.0, "memory")
    assert run_verifier(python_exec, "import sys; sys.exit(2)", "") == (
        0.0,
        "crashed: SystemExit: 2",
    )


def test_snippet_output_is_capped():
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=4, output_bytes=1000)
    result = run_python_snippet("print('x' * 5000)", limits)
    assert result.error.startswith("crashed: OSError") and "File too large" in result.error


def test_a_snippet_writes_few_files_so_its_writes_stay_bounded_in_all():
    """The file-size limit holds per file: without a count, a snippet could fill the disk
    with many files of up to `output_bytes` each within its wall-clock limit."""
    from shardrl.tasks.sandbox import MAX_FILES_WRITTEN

    limits = SandboxLimits(cpu_seconds=2, memory_mb=256, wall_seconds=10, output_bytes=1000)
    many = ("import os\nfor i in range(%d):\n    with open(f'f{i}', 'w') as f:\n"
            "        f.write('x' * 1000)\nprint('wrote')")
    assert run_python_snippet(many % MAX_FILES_WRITTEN, limits).stdout == "wrote\n"
    result = run_python_snippet(many % (MAX_FILES_WRITTEN + 1), limits)
    assert result.error == (f"crashed: PermissionError: not allowed in the sandbox: writing "
                            f"more than {MAX_FILES_WRITTEN} files")
    raw = (f"import os\nfor i in range({MAX_FILES_WRITTEN + 1}):\n"
           "    os.close(os.open(f'r{i}', os.O_RDWR | os.O_CREAT))")
    assert run_python_snippet(raw, limits).error.endswith(f"more than {MAX_FILES_WRITTEN} files")
    reads = (f"import os\nfor i in range({4 * MAX_FILES_WRITTEN}):\n"
             "    open(os.devnull).close()\nprint('read')")
    assert run_python_snippet(reads, limits).stdout == "read\n"  # reading is not counted
    again = (f"for i in range({4 * MAX_FILES_WRITTEN}):\n    with open('log', 'a') as f:\n"
             "        f.write('x')\nprint(len(open('log').read()))")
    assert run_python_snippet(again, limits).stdout == f"{4 * MAX_FILES_WRITTEN}\n"  # one file
    moved = (f"import os\nfor i in range({MAX_FILES_WRITTEN + 1}):\n"
             "    open('a', 'w').write('x' * 1000)\n    os.rename('a', f'b{i}')")
    assert run_python_snippet(moved, limits).error.endswith(f"more than {MAX_FILES_WRITTEN} files")
    # a database writes its files from native code, unseen by the count
    assert run_python_snippet("import sqlite3", limits).error == (
        "crashed: PermissionError: not allowed in the sandbox: import _sqlite3")


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("```py\nprint(1)\n```\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_failing_samples_cost_only_themselves_and_are_counted():
    """A batch where one response loops, one allocates without bound and one crashes: those
    three get reward 0 with their reason, the others are scored as usual."""
    spec = RewardSpec(verifiers=(VerifierTerm("python_exec"),), sandbox=LIMITS)
    responses = ["print(45)", "while True:\n    pass", "x = bytearray(10**10)",
                 "raise ValueError('boom')", "print(40 + 5)"]
    rows = score_batch(spec, build_verifiers(spec), responses, ["45"] * 5, [1] * 5)
    assert [r["reward_rm"] for r in rows] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert [r["correct"] for r in rows] == [True, False, False, False, True]
    assert [r["reward_error"] for r in rows] == [
        None, "python_exec: timeout", "python_exec: memory",
        "python_exec: crashed: ValueError: boom", None]
    assert error_count(rows) == 3


def test_open_files_are_limited_and_configurable():
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=4, open_files=32)
    result = run_python_snippet(
        "import os\nfds = [os.open(os.devnull, os.O_RDONLY) for _ in range(64)]\nprint('all')",
        limits)
    assert result.error.startswith("crashed: OSError") and "Too many open files" in result.error
    assert run_python_snippet("print('ok')", limits).stdout == "ok\n"
    from shardrl.config import load_config
    from shardrl.tasks.rewards import spec_from_config

    cfg = load_config("demo", ["reward.sandbox.open_files=64", "reward.sandbox.output_bytes=4096"])
    spec = spec_from_config(cfg)
    assert (spec.sandbox.open_files, spec.sandbox.output_bytes) == (64, 4096)


@pytest.mark.parametrize(("code", "refused"), [
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.execv('/bin/sh', ['sh', '-c', 'true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import subprocess\nsubprocess.run(['true'])", "import _posixsubprocess"),
    ("import ctypes\nctypes.CDLL(None).fork()", "import _ctypes"),
])
def test_a_snippet_cannot_start_processes_or_load_native_code(code, refused):
    """The limits hold per process: a fork bomb, or 64 children of 480 MB each, must not
    get past them, so the child may start no process (nor call native code that would)."""
    result = run_python_snippet(code, LIMITS)
    assert result.error == f"crashed: PermissionError: not allowed in the sandbox: {refused}"


@pytest.mark.parametrize(("code", "refused"), [
    ("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 15)", "pidfd"),
    ("import signal\nsignal.pidfd_send_signal(3, 15)", "pidfd"),
    ("import sys\ndel sys.modules['posix']\nimport posix", "import posix"),
    ("import sys\ndel sys.modules['_signal']\nimport _signal", "import _signal"),
])
def test_a_snippet_cannot_signal_its_parent_by_process_descriptor(code, refused):
    """`os.kill` is refused by the audit hook; a signal sent through a process file
    descriptor raises no audit event, so those calls are refused in the child and their
    modules cannot be imported afresh. A Python-level block only: the README says what it
    does not stop (a module built through `_imp`)."""
    parent_alive = os.getpid()
    result = run_python_snippet(code, LIMITS)
    assert result.error == f"crashed: PermissionError: not allowed in the sandbox: {refused}"
    assert os.getpid() == parent_alive


def test_a_sandboxed_verifier_cannot_start_processes_or_signal_others(reward_module):
    parent_alive = os.getpid()
    assert run_verifier(sandboxed_verifier(f"{reward_module}:run_program", LIMITS), "", "") == (
        0.0, "crashed: PermissionError: not allowed in the sandbox: subprocess.Popen")
    assert run_verifier(sandboxed_verifier(f"{reward_module}:signal_parent", LIMITS), "", "") \
        == (0.0, "crashed: PermissionError: not allowed in the sandbox: os.kill")
    assert os.getpid() == parent_alive  # still here: the SIGTERM was never sent
    assert run_verifier(sandboxed_verifier(f"{reward_module}:signal_self", LIMITS), "", "") == (
        1.0, None)


def test_a_child_that_closes_its_result_pipe_does_not_make_the_parent_spin():
    """A closed pipe stays readable: watched still, the parent would spin for the whole
    wall-clock limit."""
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, wall_seconds=2)
    cpu = time.process_time()
    result = run_python_snippet("import os, sys, time\nos.close(int(sys.argv[2]))\n"
                                "time.sleep(30)", limits)
    assert result.error == "timeout"
    assert time.process_time() - cpu < 0.5  # spinning would be about 2 s of CPU


def test_a_sandbox_that_cannot_start_is_an_error_not_an_exception(monkeypatch):
    """Out of processes or disk, the call fails like any sandboxed failure (a tool turn of an
    episode gets it as its reply) instead of raising into the rollout."""
    import subprocess

    def refuse(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    result = run_python_snippet("print(1)", LIMITS)
    assert result.error == ("crashed: the sandbox did not start: [Errno 11] Resource "
                            "temporarily unavailable")


def test_a_kill_under_the_cpu_limit_is_not_called_a_timeout():
    """SIGKILL comes at the hard CPU limit, but also from the out-of-memory killer: the CPU the
    child used tells them apart."""
    result = run_python_snippet("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                                LIMITS)
    assert result.error.startswith("crashed: killed (SIGKILL) after "), result.error
    assert "under its limit" in result.error
    spin = run_python_snippet("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                              "while True:\n    pass", SandboxLimits(cpu_seconds=1,
                                                                      memory_mb=256,
                                                                      wall_seconds=6))
    assert spin.error == "timeout"  # killed at the hard limit, a second past the soft one


def test_what_the_child_puts_in_its_folder_does_not_stall_the_parent():
    """The child's folder is its own: a FIFO or a link to an endless device where its
    output files were must not block the parent, nor feed it without end."""
    import threading

    code = ("import os\n"
            "for name in ('.stdout', '.stderr'):\n"
            "    try:\n        os.remove(name)\n    except FileNotFoundError:\n        pass\n"
            "os.mkfifo('.stdout')\nos.symlink('/dev/zero', '.stderr')\nprint('still judged')")
    results = []
    call = threading.Thread(target=lambda: results.append(run_python_snippet(code, LIMITS)),
                            daemon=True)
    call.start()
    call.join(timeout=20)
    assert results, "the parent is stuck on what the child left in its folder"
    assert results[0].error is None and results[0].stdout == "still judged\n"


def test_a_stopped_call_takes_its_child_along(monkeypatch):
    """A call stopped while its child runs (a stage's SIGTERM, an error) kills the child:
    in a session of its own, nothing else would reach it."""
    from shardrl.tasks import sandbox

    pids = []

    def stopped(proc, *args):
        pids.append(proc.pid)
        time.sleep(0.3)
        raise RuntimeError("stopped")

    monkeypatch.setattr(sandbox, "_collect", stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        run_python_snippet("import time\ntime.sleep(60)", LIMITS)
    assert pids and not alive(pids[0])


def test_a_killed_parent_takes_its_child_along(tmp_path):
    """SIGKILL leaves the parent no chance to kill its child: the kernel does it."""
    import signal
    import subprocess

    script = tmp_path / "parent.py"
    script.write_text("from shardrl.tasks.sandbox import SandboxLimits, run_python_snippet\n"
                      "run_python_snippet('import time\\ntime.sleep(60)', SandboxLimits("
                      "cpu_seconds=30, memory_mb=256, wall_seconds=60))\n")
    parent = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 20
        while not (found := children(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = found[0]
        time.sleep(0.3)  # past its start: the death signal is armed before the snippet runs
        assert alive(child)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@pytest.mark.parametrize(("code", "refused"), [
    ("import __main__ as m\nfor v in list(vars(m).values()):\n"
     "    if isinstance(v, (set, dict)):\n        v.clear()\nimport os\nos.fork()", "os.fork"),
    ("import gc\ngc.get_objects()", "gc.get_objects"),
])
def test_the_guard_is_out_of_the_snippets_reach(code, refused):
    """The guard's settings are not module globals a snippet can import and empty, and the
    heap walk that would find its hook is refused."""
    result = run_python_snippet(code, LIMITS)
    assert result.error == f"crashed: PermissionError: not allowed in the sandbox: {refused}"


def _walls() -> tuple[str, ...]:
    return run_python_snippet("pass", LIMITS).walls


def _needs(wall: str) -> None:
    if wall not in _walls():
        pytest.skip(f"no {wall} on this machine")


@pytest.mark.parametrize("code", [
    # a fresh `posix` and `_signal` built through `_imp` carry none of the guard's patches
    "import _imp, importlib.machinery as m\n"
    "p = _imp.create_builtin(m.ModuleSpec('posix', None))\n"
    "s = _imp.create_builtin(m.ModuleSpec('_signal', None))\n"
    "s.pidfd_send_signal(p.pidfd_open(p.getppid()), 0)",
    "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
    "import socket\nsocket.socket(socket.AF_UNIX)",
    # another process of the same user: its limits, scheduling and priority stay its own
    "import resource\nresource.prlimit({victim}, resource.RLIMIT_NOFILE, (3, 3))",
    "import resource\nresource.prlimit({victim}, resource.RLIMIT_CPU, (1, 1))",
    "import os\nos.sched_setaffinity({victim}, {{0}})",
    "import os\nos.sched_setscheduler({victim}, os.SCHED_IDLE, os.sched_param(0))",
    "import os\nos.setpriority(os.PRIO_PROCESS, {victim}, 19)",
    "import os\nos.setpriority(os.PRIO_PGRP, {victim}, 19)",
    # a pipe's owner gets a signal on I/O: no other process may be named its owner
    "import fcntl, os\nr, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, {victim})",
    # a lease holds up others' opens of the file; a datagram reaches any named socket
    "import fcntl\nf = open('x', 'w')\nfcntl.fcntl(f, fcntl.F_SETLEASE, fcntl.F_WRLCK)",
    "import socket\nsocket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)",
])
def test_the_kernel_refuses_what_gets_past_the_guard(code):
    """The audit hook is a guard inside the interpreter; the seccomp filter is the wall:
    no signal by process descriptor or I/O owner, no socket, no hold on another process of
    the same user, whatever reached the call."""
    import subprocess

    _needs("seccomp")
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a group of its own
    try:
        def state():
            return (resource.prlimit(victim.pid, resource.RLIMIT_NOFILE),
                    resource.prlimit(victim.pid, resource.RLIMIT_CPU),
                    os.sched_getaffinity(victim.pid), os.sched_getscheduler(victim.pid),
                    os.getpriority(os.PRIO_PROCESS, victim.pid))
        before = state()
        result = run_python_snippet(code.format(victim=victim.pid), LIMITS)
        assert result.error == "crashed: PermissionError: [Errno 1] Operation not permitted"
        assert state() == before
    finally:
        victim.kill()
        victim.wait()


def test_its_own_limits_and_devices_stay_out_of_reach(reward_module):
    """It cannot lift the death signal that ties it to its parent, nor make a device node
    (a child of root keeps no capability)."""
    _needs("seccomp")
    assert run_sandboxed_call(f"{reward_module}:keep_running_after_the_parent", [],
                              LIMITS).value == -1.0
    mknod = "import os, stat\nos.mknod('kmsg', stat.S_IFCHR | 0o600, os.makedev(1, 11))"
    assert run_python_snippet(mknod, LIMITS).error.startswith("crashed: PermissionError")


def test_threads_and_its_own_signals_still_work():
    code = ("import os, signal, threading\nout = []\n"
            "t = threading.Thread(target=out.append, args=(7,)); t.start(); t.join()\n"
            "os.kill(os.getpid(), 0); os.killpg(0, 0); signal.pthread_kill(threading.main_thread().ident, 0)\n"
            "print(out[0])")
    assert run_python_snippet(code, LIMITS) == SandboxResult(stdout="7\n", walls=_walls())


@pytest.mark.parametrize(("code", "path"), [
    ("import os\nopen('/proc/%d/environ' % os.getppid(), 'rb').read()", "/proc/"),
    ("import os\nos.listdir('{folder}')", "{folder}"),
    ("open('{outside}', 'w').write('x')", "{outside}"),
    ("import os\nos.symlink('{outside}', 'link')\nopen('link', 'w').write('x')", "link"),
])
def test_the_file_system_is_the_interpreters_and_the_calls_folder(code, path, tmp_path):
    """Landlock: the parent's environment (its credentials), other folders and files outside
    the call's folder are out of reach; the folder itself is the code's."""
    _needs("landlock")
    outside = tmp_path / "written-from-the-sandbox"
    result = run_python_snippet(code.format(outside=outside, folder=tmp_path), LIMITS)
    assert result.error.startswith("crashed: PermissionError: [Errno 13] Permission denied: ")
    assert path.format(outside=outside, folder=tmp_path) in result.error
    assert not outside.exists()
    inside = "import os\nos.mkdir('d'); open('d/f', 'w').write('1'); print(open('d/f').read())"
    assert run_python_snippet(inside, LIMITS).stdout == "1\n"


def test_a_sandboxed_verifier_cannot_read_its_parents_credentials(reward_module, monkeypatch):
    _needs("landlock")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    result = run_sandboxed_call(f"{reward_module}:parent_environ", [], LIMITS)
    assert result.error.startswith("crashed: PermissionError: [Errno 13] Permission denied")
    assert "hunter2" not in result.error + result.stdout


def test_a_missing_wall_is_said_once(caplog):
    from shardrl.tasks import sandbox

    sandbox._unwalled.clear()
    with caplog.at_level("WARNING", logger="shardrl.sandbox"):
        sandbox._note_walls(("seccomp",))
        sandbox._note_walls(())
        sandbox._note_walls(())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and said[0].startswith("sandbox: the sandbox's child could not drop")
    assert said[1].startswith("sandbox: no Landlock") and said[2].startswith("sandbox: no seccomp")
    sandbox._unwalled.clear()


def test_a_verifier_in_the_working_folder_reads_itself_not_its_neighbours(tmp_path,
                                                                          monkeypatch):
    """`python -m` or a notebook puts the working folder on the import path: a verifier
    there is imported from it, but the folder's other files (credentials, the run's data)
    stay unread, while the interpreter's files, harmless system files and packages
    installed in editable mode can be."""
    _needs("landlock")
    (tmp_path / "secret.txt").write_text("hunter2")
    (tmp_path / "cwd_reward.py").write_text(
        "import getpass, mimetypes\n"
        "def score(response, answer):\n"
        "    assert mimetypes.guess_type('a.json')[0] == 'application/json' and getpass.getuser()\n"
        "    return open('" + str(tmp_path / "secret.txt") + "').read()\n")
    monkeypatch.chdir(tmp_path)
    # the folder as `python -m` names it, and a folder above it as a `.pth` could
    monkeypatch.setattr(sys, "path", ["", str(tmp_path.parent), *sys.path])
    result = run_sandboxed_call("cwd_reward:score", ["", ""], LIMITS)
    assert result.error == ("crashed: PermissionError: [Errno 13] Permission denied: "
                            f"'{tmp_path / 'secret.txt'}'")
    assert run_sandboxed_call("reward_fns_absent:score", [], LIMITS).error.startswith(
        "crashed: ModuleNotFoundError")


def test_a_verifier_may_import_the_project_itself(reward_module):
    assert run_sandboxed_call(f"{reward_module}:uses_the_project", [], LIMITS).value == 1.0


@pytest.mark.parametrize("code", [
    "import os\nos.chmod('{victim}', 0o4777)",
    "import os\nos.utime('{victim}', (0, 0))",
    "import os\nos.setxattr('{victim}', 'user.mark', b'1')",
    "import os\nos.truncate('{victim}', 0)",
    "import os\nf = open('mine', 'w')\nos.fchmod(f.fileno(), 0o4777)",
])
def test_files_it_cannot_write_keep_their_bytes_modes_and_times(code, tmp_path):
    """Landlock guards a file's bytes, not its metadata (nor, before Linux 6.2, truncation
    by name): modes, owners, times and attributes stay the filter's to refuse, also for
    files in its own folder (a mode set there could outlive it)."""
    _needs("seccomp")
    victim = tmp_path / "victim"
    victim.write_text("kept")
    os.chmod(victim, 0o640)
    before = victim.stat()
    result = run_python_snippet(code.format(victim=victim), LIMITS)
    assert result.error.startswith("crashed: PermissionError: [Errno 1] Operation not permitted")
    after = victim.stat()
    assert (after.st_mode, after.st_mtime_ns, after.st_size, victim.read_text()) == (
        before.st_mode, before.st_mtime_ns, before.st_size, "kept")


def test_what_ordinary_code_needs_still_works(reward_module):
    """Its own priority, a stream socket pair (asyncio's wake-up pipe), and the capabilities
    dropped."""
    code = ("import os, socket\nos.nice(1)\na, b = socket.socketpair()\na.send(b'ran')\n"
            "print(b.recv(3).decode())")
    result = run_python_snippet(code, LIMITS)
    assert (result.error, result.stdout) == (None, "ran\n")
    assert set(result.walls) >= {"capabilities"}
    assert run_sandboxed_call(f"{reward_module}:good", ["a", "a"], LIMITS).walls == result.walls


def test_no_system_v_memory_outlives_the_child(reward_module):
    _needs("seccomp")
    assert run_sandboxed_call(f"{reward_module}:system_v_memory", [], LIMITS).value == [-1] * 3


def test_only_the_interpreters_own_ioctls_and_known_calls_pass(reward_module):
    """A file's flags and attributes (`FS_IOC_SETFLAGS`, `FS_IOC_FSSETXATTR`: a sync flag
    on a folder of the run) are not the code's: ioctl is an allowlist. System calls newer
    than the filter are unknown to it and answer ENOSYS."""
    _needs("seccomp")
    code = ("import fcntl, os, socket\nprint(os.isatty(0))\nsocket.socketpair()[0].setblocking(False)"
            "\nfcntl.ioctl(0, 0x80086601, bytes(8))")  # FS_IOC_GETFLAGS
    result = run_python_snippet(code, LIMITS)
    assert (result.stdout, result.error) == (
        "False\n", "crashed: PermissionError: [Errno 1] Operation not permitted")
    assert run_sandboxed_call(f"{reward_module}:newer_than_the_filter", [], LIMITS).value == [
        -1, 38]


def test_a_working_folder_inside_the_interpreters_is_still_left_out(monkeypatch):
    """Every grant obeys the rule, the interpreter's own folders too: run from the
    interpreter's prefix, the child still reads its library below but not the folder."""
    _needs("landlock")
    monkeypatch.chdir(sys.base_prefix)
    code = f"import json, os\nprint(json.dumps(1))\nos.listdir({sys.base_prefix!r})"
    result = run_python_snippet(code, LIMITS)
    assert result.stdout == "1\n"
    assert result.error.startswith("crashed: PermissionError: [Errno 13] Permission denied")


def test_a_namespace_package_in_the_working_folder_is_found(tmp_path, monkeypatch):
    (tmp_path / "verifiers_ns").mkdir()
    (tmp_path / "verifiers_ns" / "exact.py").write_text(
        "def score(response, answer):\n    return float(response == answer)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    result = run_sandboxed_call("verifiers_ns.exact:score", ["a", "a"], LIMITS)
    assert (result.value, result.error) == (1.0, None)
