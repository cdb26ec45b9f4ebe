"""Waiting for new objects: a stage wakes when something is committed, not on a timer.

A stage that has nothing to do calls `watch.wait(timeout)` instead of sleeping, then looks
again (lists, reads a pointer). A stage that is busy can ask `watch.changed()` before it
lists, and skip a listing that would find nothing. `wait` returns early when an object may have appeared under
the watched prefix and at the latest after `timeout`, so a missed wake-up costs at most one
timeout, never correctness: callers always re-check the store itself.

- `PollWatch` (any store, S3 included): short adaptive sleeps. The first wait after work was
  found is `min_s`, each empty wait doubles it, up to the caller's timeout; `reset()` (the
  caller found work) starts again at `min_s`. Quiet stages settle at their poll interval;
  busy ones look every few milliseconds.
- `InotifyWatch` (the folder store on Linux): the kernel reports each rename that commits an
  object (`IN_MOVED_TO`) and each new folder (a new version), which is watched in turn up
  to `depth` levels below the prefix. A commit wakes the waiter within a millisecond. After
  the kernel's event queue overflowed it watches the folders created meanwhile; out of inotify
  watches for a new folder, it polls from then on rather than fail.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import select
import struct
import sys
import time
from pathlib import Path

MIN_POLL_S = 0.005
"""First wait of `PollWatch` after work was found."""

MAX_WATCHED_FOLDERS = 256
"""Folders one `InotifyWatch` follows; past this the oldest (by name) are dropped, since new
objects land in the newest versions. A dropped folder costs latency (the timeout), not data."""


class PollWatch:
    """Adaptive polling (see the module docstring)."""

    def __init__(self, min_s: float = MIN_POLL_S) -> None:
        self.min_s = min_s
        self.delay = min_s

    def wait(self, timeout: float) -> bool:
        """Sleep min(current delay, timeout), then double the delay. True: look again."""
        time.sleep(min(self.delay, timeout))
        self.delay = min(self.delay * 2, max(timeout, self.min_s))
        return True

    def changed(self) -> bool:
        """Whether something may have been committed since the last look, without waiting:
        always, since polling cannot tell (the caller looks)."""
        return True

    def reset(self) -> None:
        """The caller found work: the next wait is short again."""
        self.delay = self.min_s

    def close(self) -> None:
        pass


# inotify(7) constants
_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x08, 0x80, 0x100
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR = 0x4000, 0x8000, 0x40000000
_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
_MASK = _IN_MOVED_TO | _IN_CREATE | _IN_CLOSE_WRITE
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of name


@functools.cache
def _libc():
    """The C library with the inotify calls (looked up once: `find_library` runs a
    subprocess), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


class InotifyWatch:
    """Wakes on objects committed under `folder` (and its sub-folders, `depth` levels down)."""

    def __init__(self, libc, folder: Path, depth: int) -> None:
        self.libc, self.folder, self.depth = libc, folder, depth
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd = fd
        self.paths: dict[int, tuple[Path, int]] = {}
        """watch descriptor -> (folder, its depth below the prefix)"""
        folder.mkdir(parents=True, exist_ok=True)
        self._add(folder, 0)
        self.polling: PollWatch | None = None
        """Set once a new folder could not be watched (the user is out of inotify watches):
        from then on this watch polls, as on a store without notifications."""

    def _add(self, folder: Path, level: int) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return  # removed meanwhile
            raise OSError(err, f"inotify_add_watch {folder} failed")
        self.paths[wd] = (folder, level)
        if level < self.depth:
            with os.scandir(folder) as it:
                subs = sorted(e.name for e in it if e.is_dir(follow_symlinks=False)
                              and not e.name.startswith("."))
            for name in subs[-MAX_WATCHED_FOLDERS:]:
                self._add(folder / name, level + 1)
        self._bound()

    def _bound(self) -> None:
        if len(self.paths) <= MAX_WATCHED_FOLDERS:
            return
        deeper = sorted((p, wd) for wd, (p, level) in self.paths.items() if level > 0)
        for _, wd in deeper[:len(self.paths) - MAX_WATCHED_FOLDERS]:
            self.libc.inotify_rm_watch(self.fd, wd)
            self.paths.pop(wd, None)

    def wait(self, timeout: float) -> bool:
        """Block until an object is committed below the folder or `timeout` passes.

        True when something was committed (or may have been: a new folder, an overflow).
        """
        if self._drain():
            return True
        if self.polling is not None:
            return self.polling.wait(timeout)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and self._drain():  # not only temp files of writes in progress
                return True
        return False

    def changed(self) -> bool:
        """Whether an object was committed since the last `wait` or `changed`, without
        waiting (what a commit reported is taken, as by `wait`)."""
        return self._drain() or self.polling is not None

    def _follow(self, folder: Path, level: int) -> None:
        """Watch a new folder; out of watches, poll from now on instead of failing."""
        try:
            self._add(folder, level)
        except OSError as exc:
            if self.polling is None:
                print(f"store watch: {exc}; polling {self.folder} instead", file=sys.stderr,
                      flush=True)
                self.polling = PollWatch()

    def _rescan(self) -> None:
        """After the kernel's event queue overflowed: watch the folders created meanwhile."""
        watched = {path for path, _ in self.paths.values()}
        for folder, level in list(self.paths.values()):
            if level >= self.depth:
                continue
            try:
                with os.scandir(folder) as it:
                    subs = [folder / e.name for e in it if e.is_dir(follow_symlinks=False)
                            and not e.name.startswith(".")]
            except OSError:  # removed meanwhile
                continue
            for sub in sorted(subs)[-MAX_WATCHED_FOLDERS:]:
                if sub not in watched:
                    self._follow(sub, level + 1)

    def _drain(self) -> bool:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return False
        woke, offset = False, 0
        while offset < len(data):
            wd, mask, _, size = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size: offset + _EVENT.size + size]
            offset += _EVENT.size + size
            name = raw.split(b"\0", 1)[0].decode(errors="replace")
            if mask & _IN_Q_OVERFLOW:  # events were lost, new folders' among them
                self._rescan()
                woke = True
                continue
            if mask & _IN_IGNORED:
                self.paths.pop(wd, None)
                continue
            if wd not in self.paths or not name or name.startswith("."):
                continue  # temp files of writes in progress
            folder, level = self.paths[wd]
            if mask & _IN_ISDIR:
                if level < self.depth:
                    self._follow(folder / name, level + 1)
                    woke = True  # objects may have landed before the watch did
            elif mask & (_IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_CREATE):
                woke = True  # renamed to its name, or linked to it (`put_if_absent`)
        return woke

    def reset(self) -> None:
        if self.polling is not None:
            self.polling.reset()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def folder_watch(folder: Path, depth: int) -> InotifyWatch | PollWatch:
    """An `InotifyWatch` on `folder` where the kernel offers one, else a `PollWatch`."""
    libc = _libc()
    if libc is not None:
        try:
            return InotifyWatch(libc, folder, depth)
        except OSError:
            pass  # no inotify here, or out of watches: poll
    return PollWatch()
