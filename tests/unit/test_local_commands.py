"""The local runner starts each stage with the graph's command line, under this interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shardrl.config import load_config
from shardrl.orchestrate import local as local_module
from shardrl.orchestrate.local import LocalRun
from shardrl.store import LocalStore


def local_run(tmp_path: Path, overrides: list[str]) -> LocalRun:
    cfg = load_config("demo", overrides)
    return LocalRun(cfg, "r1", str(tmp_path), LocalStore(str(tmp_path)), tmp_path,
                    tmp_path / "config.yaml")


def test_stages_run_as_modules_of_this_interpreter(tmp_path):
    run = local_run(tmp_path, ["rollout.workers=2"])
    assert run.command("learn", 0)[:5] == [sys.executable, "-m", "shardrl.cli", "stage", "learn"]
    rollout = run.command("rollout", 1)
    assert rollout[rollout.index("--worker") + 1] == "1"
    assert rollout[rollout.index("--workers") + 1] == "2"


def test_a_multi_rank_learner_starts_under_torchrun(tmp_path):
    run = local_run(tmp_path, ["learner.backend.kind=deepspeed", "learner.backend.ranks=3"])
    cmd = run.command("learn", 0)
    assert cmd[:7] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=3", "-m", "shardrl.cli"]
    assert cmd[7:9] == ["stage", "learn"] and cmd[cmd.index("--run-id") + 1] == "r1"
    # other stages stay single processes
    assert run.command("score", 0)[:3] == [sys.executable, "-m", "shardrl.cli"]


@pytest.fixture
def four_cores(monkeypatch):
    """A machine with cores 0-3 online, whatever this one has."""
    monkeypatch.setattr(local_module, "machine_cores", lambda: {0, 1, 2, 3})


def test_stages_share_cores_unless_pinned(tmp_path, four_cores):
    run = local_run(tmp_path, ["pipeline.local.cores={rollout: [0], learn: [3]}",
                               "pipeline.local.share_cores=true"])
    env, cpus = run.placement("rollout")
    assert cpus == {0} and "SHARDRL_CORE_SHARE" not in env and env["OMP_NUM_THREADS"] == "1"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"  # stages share cores: no spinning threads
    assert run.placement("learn")[1] == {3}
    env, cpus = run.placement("evaluate")
    assert cpus is None and env["SHARDRL_CORE_SHARE"] == str(tmp_path / "cores")
    assert (tmp_path / "cores").is_dir()
    off = local_run(tmp_path, ["pipeline.local.share_cores=false"])
    assert "SHARDRL_CORE_SHARE" not in off.placement("learn")[0]


def test_one_rollout_worker_placed_apart_from_the_others(tmp_path, capsys, four_cores):
    """`rollout.N` keys place one worker; the stage's key places the rest; a pin keeps the
    cores the machine has, saying which it dropped, and a pin naming none of them is dropped
    with a warning rather than failing the start."""
    run = local_run(tmp_path, ["pipeline.local.cores={rollout.1: [2], rollout: [1, 3, 9]}",
                               "pipeline.local.nice={rollout: 5, rollout.1: 19}"])
    assert run.placement("rollout", 1)[1] == {2}
    assert capsys.readouterr().err == ""
    assert run.placement("rollout", 0)[1] == {1, 3}
    assert capsys.readouterr().err == ("pipeline.local.cores: rollout worker 0 is pinned to "
                                       "cores [1, 3, 9]; not available here (the runner's "
                                       "cpuset or online cores): 9\n")
    local = run.cfg.pipeline.local
    assert [local.placed("nice", "rollout", w) for w in (0, 1, 2)] == [5, 19, 5]
    assert local.placed("nice", "learn", 0) is None
    far = local_run(tmp_path, ["pipeline.local.cores={learn: [7, 100000]}"])
    assert far.placement("learn")[1] is None
    assert capsys.readouterr().err.endswith("online cores): 7, 100000: it runs unpinned\n")
    # null removes an entry set before (a preset's, in a file that extends it)
    undone = local_run(tmp_path, ["pipeline.local.cores={rollout.0: [0], learn: [1]}",
                                  "pipeline.local.cores={rollout.0: null, learn: null}"])
    assert undone.placement("rollout", 0)[1] is None and undone.placement("learn")[1] is None
    for bad in ("{rollout.x: [0]}", "{learn.1: [0]}", "{rollouts: [0]}", "{rollout.01: [0]}",
                "{rollout.²: [0]}"):
        with pytest.raises(ValueError, match="name a looping stage"):
            load_config("demo", [f"pipeline.local.cores={bad}"])
    with pytest.raises(ValueError, match=r"rollout.2` names no worker: rollout.workers is 2"):
        load_config("demo", ["rollout.workers=2", "pipeline.local.nice={rollout.2: 19}"])
    # an entry removed with null names nothing
    load_config("demo", ["rollout.workers=2", "pipeline.local.cores={rollout.2: [0]}",
                         "pipeline.local.cores={rollout.2: null}"])


def test_the_machines_cores_include_the_runners():
    """A pin may name any core of the runner's cpuset, also one outside its affinity."""
    assert os.sched_getaffinity(0) <= local_module.machine_cores()


@pytest.mark.parametrize("layout", ["v2", "v1", "online"])
def test_pins_are_bounded_by_the_containers_cpuset(tmp_path, layout):
    """The cores a pin may name: the runner's cgroup cpuset (v2 or v1), else online cores."""
    proc, sys_fs = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    online = sys_fs / "devices" / "system" / "cpu" / "online"
    online.parent.mkdir(parents=True)
    online.write_text("0-15\n")
    if layout == "v2":
        (proc / "self" / "cgroup").write_text("0::/pod/box\n")
        where = sys_fs / "fs" / "cgroup" / "pod" / "box" / "cpuset.cpus.effective"
    else:
        (proc / "self" / "cgroup").write_text("4:memory:/x\n3:cpuset:/box\n0::/\n")
        where = sys_fs / "fs" / "cgroup" / "cpuset" / "box" / "cpuset.effective_cpus"
    if layout != "online":
        where.parent.mkdir(parents=True)
        where.write_text("2-3,8\n")
    cores = local_module.machine_cores(proc, sys_fs)
    assert cores == (set(range(16)) if layout == "online" else {2, 3, 8})
    assert local_module.cpu_list("0,4-5,9") == {0, 4, 5, 9}


def test_a_pin_the_container_refuses_leaves_the_stage_unpinned(tmp_path, monkeypatch):
    """Online but outside this container's cores: the kernel refuses the affinity; the stage
    starts anyway, unpinned, and its log says why."""
    run = local_run(tmp_path, ["pipeline.local.fork=false", "pipeline.local.cores={learn: [0]}"])
    monkeypatch.setattr(run, "command", lambda name, worker: [
        sys.executable, "-c", "import os; os.write(1, str(sorted(os.sched_getaffinity(0))).encode())"])

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)  # the child runs the same code
    proc = run.start("learn")
    assert proc.popen.wait(timeout=30) == 0
    said = proc.log.read_text()
    assert said.startswith("pipeline.local.cores: cores [0] are not available here: this "
                           "stage runs unpinned\n")
    assert said.splitlines()[-1] == str(sorted(os.sched_getaffinity(0)))


PROBE = ("import os; assert os.read(0, 1) == b''; os.write(1, ' '.join(map(str, ("
         "os.nice(0), os.getsid(0), os.getpgid(0), os.getpid()))).encode())")
"""Writes to descriptor 1 (the log, in a forked child too) once descriptor 0 read nothing."""


@pytest.fixture
def runner_stdin_with_input():
    """The runner's descriptor 0 with input waiting: a stage that inherited it would read it."""
    read, write = os.pipe()
    os.write(write, b"typed at the runner's terminal\n")
    saved = os.dup(0)
    os.dup2(read, 0)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)


def probed(proc) -> tuple[int, int, int, int]:
    """(niceness, session, process group, pid) the stage's probe printed last."""
    return tuple(map(int, proc.log.read_text().split()[-4:]))


def test_generation_and_evaluation_yield_the_cores_to_the_learner(tmp_path, monkeypatch,
                                                                   runner_stdin_with_input):
    """Each stage runs at its niceness in a process group of its own (which stopping it
    signals) but in the runner's session: with autogroup scheduling every session gets an
    equal share of the CPU and niceness weighs only within one, so stages in sessions of
    their own would ignore it. Its standard input is empty, not the runner's (a background
    group reading the terminal would be stopped)."""
    run = local_run(tmp_path, ["pipeline.local.fork=false"])
    assert run.cfg.pipeline.local.nice == {"rollout": 5, "evaluate": 10}  # the default
    monkeypatch.setattr(run, "command", lambda name, worker: [sys.executable, "-c", PROBE])
    base = os.nice(0)
    for name, more in (("rollout", 5), ("evaluate", 10), ("learn", 0)):
        proc = run.start(name)
        assert proc.popen.wait(timeout=30) == 0
        nice, sid, pgid, pid = probed(proc)
        assert nice == min(base + more, 19), name
        assert (sid, pgid, pid) == (os.getsid(0), proc.popen.pid, proc.popen.pid), name
    with pytest.raises(ValueError, match="niceness from 0 to 19"):
        load_config("demo", ["pipeline.local.nice={rollout: 20}"])


def test_a_forked_stage_keeps_the_runners_session(tmp_path, monkeypatch,
                                                  runner_stdin_with_input):
    """The same placement for a stage forked from the runner (`pipeline.local.fork`)."""
    import shardrl.cli

    run = local_run(tmp_path, ["pipeline.local.fork=true"])
    monkeypatch.setattr(shardrl.cli, "main", lambda argv: exec(PROBE) or 0)  # runs in the child
    proc = run.start("rollout")
    assert proc.popen.wait(timeout=30) == 0
    nice, sid, pgid, pid = probed(proc)
    assert nice == min(os.nice(0) + 5, 19)
    assert (sid, pgid, pid) == (os.getsid(0), proc.popen.pid, proc.popen.pid)
