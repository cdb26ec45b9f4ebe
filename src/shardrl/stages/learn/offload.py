"""Where a commit's writes run: on the writer thread, or in a child process beside it.

A commit's writes are a list of `Write`s: publishing the new version's weights (a delta
against the version before, serialized, hashed, written with its manifest), the JSON
records, the LATEST pointer. `Writes.run` does them in order, in this process.

Most of their CPU time is Python holding the interpreter lock (the delta's comparisons, the
safetensors header, the sha256 of small files, pydantic and json for each record). On the
writer thread they hold up the next update, whose forward pass needs that lock between its
operators, however many cores are idle: at the demo's size a step took about 42 ms with the
writes on the thread, 39 ms with them in a child process, 35.5 ms for the same update with
no store at all. `CommitProcess` is that child, forked when the learner starts
(`learner.commit_writer`): the writer thread sends it each list (tensors as raw bytes over a
pipe, the lock released while they are written) and waits for the answer.

It is forked before the learner loads its model or starts a thread, so it shares none of the
model's pages, and runs torch on one thread (so it never enters an OpenMP parallel region,
which a fork can leave unusable). `auto`
keeps models whose published weights pass 64 MiB on the thread: the child would hold a
copy of them, and the Python work it saves does not grow with the model.

The child never writes on its own: each list is one request, answered once every write in
it is in the store. So the commit order, and at most one commit in flight, stay the writer
thread's, which also keeps the writes that need this process's memory (the optimizer
checkpoint's live tensors, retention). The live doctor's checks (`Check`) run where the
writes do: each reads the run's new metric chunks and runs the rules, 8-15 ms of Python at
the demo's size that would otherwise hold the learner's interpreter lock every
`learner.doctor_every` steps; the doctor's state (what it read, what it reported) lives
there. An error in the child comes back as the same exception (a `StoreUnavailable` stays
one) and fails the commit as it would on the thread. An outage the child rides out is
reported to the learner as it starts and ends, and the learner logs it as its own, once:
the learner may be making no store call of its own meanwhile, waiting for this commit. The
child keeps the weights of the last version it published (the learner keeps none), so each
version crosses the pipe once. It dies with the
learner (the kernel's parent-death signal), so the commit of a crashed learner cannot land
after its restart has read progress.json; it exits when the learner closes it or its end of
the pipe.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...lifetime import die_with_parent
from ...store import RunKeys, Store
from ...store.records import Record
from ..policy import point_latest, publish_weights

if TYPE_CHECKING:
    from ...config import RunConfig

State = dict[str, torch.Tensor]


@dataclass
class Publish:
    """Publish `weights` as policy `version` (`policy.publish_weights`), as a delta against
    the writer's last version (its base or its last publish), which must be `version - 1`
    unless `version` is a full snapshot."""

    version: int
    weights: State
    full_every: int


@dataclass
class Put:
    """Write a record at `key`."""

    key: str
    record: Record


@dataclass
class Point:
    """Move policy/LATEST.json to `version`, published by the learner step of that number."""

    version: int


@dataclass
class Check:
    """Run the live doctor over the metrics written so far, the learner at `version`
    (`doctor.live.LiveDoctor.check`: it logs and records each new finding)."""
    version: int


Write = Publish | Put | Point | Check


class Writes:
    """Runs lists of writes in this process. It keeps the weights it published last (or
    was given as its `base`): what the next version's delta is taken against; and, given
    the run's `cfg`, the live doctor that `Check`s run (made at the first)."""

    def __init__(self, store: Store, keys: RunKeys, cfg: RunConfig | None = None) -> None:
        self.store, self.keys, self.cfg = store, keys, cfg
        self.last: tuple[int, State] | None = None
        self.doctor = None

    def base(self, version: int, state: State) -> None:
        """`state` is the published weights of `version` (the learner resumed there)."""
        self.last = (version, state)

    def run(self, writes: list[Write]) -> None:
        for w in writes:
            if isinstance(w, Publish):
                previous = self.last[1] if self.last and self.last[0] == w.version - 1 else None
                publish_weights(self.store, self.keys, w.version, w.weights, previous,
                                w.full_every)
                self.last = (w.version, w.weights)
            elif isinstance(w, Put):
                w.record.write(self.store, w.key)
            elif isinstance(w, Check):
                self.check(w.version)
            else:
                point_latest(self.store, self.keys, w.version, step=w.version)

    def check(self, version: int) -> None:
        if self.cfg is None:
            raise ValueError("a doctor check needs the run's config (Writes(..., cfg))")
        if self.doctor is None:
            from ...doctor.live import LiveDoctor

            self.doctor = LiveDoctor(self.cfg, self.store, self.keys)
        self.doctor.check(version)

    def close(self) -> None:
        pass


# -- the child process ----------------------------------------------------------------------
_Spec = tuple[str, str, tuple[int, ...]]
"""A tensor on the pipe: name, dtype (`torch.float32` -> "float32"), shape."""


def _specs(state: State) -> list[_Spec]:
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in state.items()]


def _send_state(conn, state: State) -> None:
    for t in state.values():
        conn.send_bytes(t.detach().reshape(-1).view(torch.uint8).numpy())


def _receive_state(conn, specs: list[_Spec]) -> State:
    state = {}
    for name, dtype, shape in specs:
        dt = getattr(torch, dtype)
        raw = torch.empty(torch.Size(shape).numel() * dt.itemsize, dtype=torch.uint8)
        if conn.recv_bytes_into(raw.numpy()) != raw.numel():  # never publish a torn tensor
            raise EOFError(f"tensor {name!r}: the learner's message ended early")
        state[name] = raw.view(dt).reshape(shape)
    return state


def _serve(conn, parent_end, store: Store, keys: RunKeys, cfg: RunConfig | None, die) -> None:
    """The child's loop: receive a list of writes, run it, answer; until told to stop."""
    if die is not None:
        die()
    parent_end.close()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the learner decides when this ends
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(1)
    store = store.reopened()
    # an outage met here is the learner's: its start and end go to the learner, which logs
    # them once with those its own calls met (the learner may be waiting on this request,
    # making none); the error that ends one (StoreUnavailable) comes back as the answer
    store.report_outages(lambda event, cause: conn.send(("outage", event, cause)))
    writes = Writes(store, keys, cfg)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        batch: list[Write] = []
        for item in message:  # every payload is read before anything can fail
            if item[0] == "base":
                writes.base(item[1], _receive_state(conn, item[2]))
            elif item[0] == "publish":
                _, version, specs, full_every = item
                batch.append(Publish(version, _receive_state(conn, specs), full_every))
            else:
                batch.append(item[1])
        try:
            writes.run(batch)
        except BaseException as e:  # noqa: BLE001 - every error goes back to the learner
            conn.send(("error", _portable(e), traceback.format_exc()))
        else:
            conn.send(("ok", None, None))


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")


class CommitProcess:
    """Runs lists of writes in a child process (see the module docstring)."""

    def __init__(self, store: Store, keys: RunKeys, cfg: RunConfig | None = None) -> None:
        self.store, self.keys, self.cfg = store, keys, cfg
        context = multiprocessing.get_context("fork")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_end, self.conn, store, keys, cfg, die_with_parent()),
            name="learn-commit", daemon=True)
        self.process.start()
        child_end.close()
        self.pending: tuple[int, State] | None = None
        """A base not yet sent: it goes with the next list, so only the child keeps it."""
        self.broken = False
        """A request failed part-way: the child was stopped."""

    def base(self, version: int, state: State) -> None:
        """`state` is the published weights of `version` (see `Writes.base`)."""
        self.pending = (version, state)

    def run(self, writes: list[Write]) -> None:
        if self.broken:
            raise RuntimeError("the commit writer process was stopped by an earlier failure")
        message, payload = [], []
        if self.pending is not None:
            version, state = self.pending
            message.append(("base", version, _specs(state)))
            payload.append(state)
        for w in writes:
            if isinstance(w, Publish):
                message.append(("publish", w.version, _specs(w.weights), w.full_every))
                payload.append(w.weights)
            else:
                message.append(("write", w))
        try:
            self.conn.send(message)
            for state in payload:
                _send_state(self.conn, state)
            self.pending = None
            status, error, text = self.conn.recv()
            while status == "outage":  # the child met an outage: tell it as this process's
                self.store.relay_outage(error, text)
                status, error, text = self.conn.recv()
        except BaseException as e:
            # the pipe may hold half a request, which the child must never take for a whole
            # one: it is stopped, and this writer with it
            self.broken = True
            self.process.kill()
            self.process.join()
            if isinstance(e, (EOFError, OSError)):
                raise RuntimeError(f"the commit writer process exited (code "
                                   f"{self.process.exitcode}) with a commit in flight") from e
            raise
        if status != "ok":
            error.add_note(f"in the commit writer process:\n{text}")
            raise error

    def close(self) -> None:
        """Stop the child (after the writes in flight, which the writer thread waited for)."""
        if not self.broken:
            try:
                self.conn.send(None)
            except OSError:
                pass  # it is gone already
        self.process.join(timeout=10.0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self.conn.close()


PROCESS_MAX_BYTES = 64 << 20
"""Largest published state `commit_writer: auto` sends to a child process. The child keeps a
copy of it, and the Python work it saves the update (about 3 ms a commit) does not grow with
the model while the update does: past this size the thread costs less."""


def commit_writes(store: Store, keys: RunKeys, where: str, cfg: RunConfig | None = None,
                  ) -> Writes | CommitProcess:
    """What runs a learner's commit writes (and, given the run's `cfg`, its doctor's
    checks): `where` is `learner.commit_writer`. A child process (for `auto` too, until
    `settle` has seen the model's size) only on Linux, which kills it with the learner;
    elsewhere, and for `thread`, this process. Made before the learner loads anything, so
    the child shares none of the model's pages."""
    if not sys.platform.startswith("linux") or where == "thread":
        return Writes(store, keys, cfg)
    return CommitProcess(store, keys, cfg)


def settle(out: Writes | CommitProcess, where: str, state_bytes: int,
           ) -> Writes | CommitProcess:
    """`out`, or this process's `Writes` in its place when `where` is `auto` and a published
    version takes `state_bytes` > `PROCESS_MAX_BYTES` (the child is stopped)."""
    if isinstance(out, CommitProcess) and where == "auto" and state_bytes > PROCESS_MAX_BYTES:
        out.close()
        return Writes(out.store, out.keys, out.cfg)
    return out
