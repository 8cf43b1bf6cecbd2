"""Leave no process behind: end what workers leave running after they exit.

torch elastic stops a failed job with ``killpg`` on each worker that is *still running*. A worker
that already died (the one that crashed, or was SIGKILLed) is skipped, so whatever it had started
(DataLoader workers, a helper server, ``subprocess`` children) keeps running, orphaned. On Linux
the launcher makes itself a *child subreaper*, so those orphans are re-parented to it instead of
to init, and ends them: during the run once their worker is gone, and all of them at the end.

A leftover is recognised by a marker variable the launcher puts in the workers' environment
(children inherit it), so processes that are not this launch's, say other children of a test
process that calls ``launch()``, are never touched. Workers are told apart from their leftovers by
leading their own session (elastic starts them with ``start_new_session``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    zombie: bool


def _read_proc(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or ')': split at the last.
    fields = text[text.rfind(")") + 2 :].split()
    return _Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0] == "Z")


def _children() -> list[_Proc]:
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (proc := _read_proc(int(name))) is not None and proc.ppid == me:
            out.append(proc)
    return out


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    proc = _read_proc(pid)
    return proc is not None and not proc.zombie


def _end(proc: _Proc, my_pgid: int) -> None:
    """SIGKILL a leftover (and its process group when that is not ours), then reap it."""
    if not proc.zombie:
        with contextlib.suppress(OSError):
            if proc.pgid not in (my_pgid, 0):
                os.killpg(proc.pgid, signal.SIGKILL)
            os.kill(proc.pid, signal.SIGKILL)
    # It is our child (re-parented to us), so we must reap it or it stays a zombie. Bounded: a
    # process stuck in uninterruptible sleep cannot die, and the launcher must still exit.
    deadline = time.monotonic() + 2.0
    while True:
        try:
            pid, _ = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid != 0 or time.monotonic() > deadline:
            return
        time.sleep(0.01)


class OrphanReaper:
    """Context manager: become a subreaper, sweep leftovers while running and on exit.

    ``marker`` is a ``NAME=value`` pair present in the environment of every worker. On platforms
    without ``/proc`` and ``prctl`` (anything but Linux) it does nothing.
    """

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        self._marker = marker.encode()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._enabled = sys.platform.startswith("linux") and os.path.isdir("/proc")
        # Pids of the running leftovers this reaper ended (written by its thread, read after).
        self.ended: list[int] = []

    def __enter__(self) -> OrphanReaper:
        if self._enabled:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._enabled = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            except (OSError, AttributeError):
                self._enabled = False
        if self._enabled:
            self._thread = threading.Thread(target=self._loop, name="longboat-reaper", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._enabled:
            self.sweep(everything=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sweep(everything=False)

    def sweep(self, everything: bool) -> None:
        """End this launch's leftovers that were re-parented to us.

        ``everything=False`` (during the run): only those whose worker (their session leader)
        has exited, so a running worker's own helpers are never touched. ``everything=True``
        (after the agent has stopped and reaped all workers): all of them, repeated until none is
        left, since ending one can re-parent its children to us. Zombies in a foreign session
        that do not lead it can only be re-parented orphans: they are reaped either way.
        """
        my_sid, my_pgid = os.getsid(0), os.getpgid(0)
        deadline = time.monotonic() + 10.0
        while True:
            leftovers = []
            for p in _children():
                if p.zombie:
                    if p.sid != my_sid and p.pid != p.sid:
                        leftovers.append(p)
                elif _has_marker(p.pid, self._marker) and (
                    everything or (p.pid != p.sid and not _alive(p.sid))
                ):
                    leftovers.append(p)
            if not leftovers:
                return
            for proc in leftovers:
                _end(proc, my_pgid)
                if not proc.zombie:  # a zombie had already ended; it only needed reaping
                    self.ended.append(proc.pid)
            if not everything or time.monotonic() > deadline:
                return
