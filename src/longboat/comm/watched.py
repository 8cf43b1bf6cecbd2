"""Waits that a word from outside can cut short: a collective of a group that another rank
already gave up on.

[Note: watched waits] With gloo, a rank blocked in a ring all-reduce hears only from its ring
neighbours: when a rank two steps away dies, the neighbours get "connection closed" at once,
but this rank waits for data that will never come, until its own timeout (``comm.timeout_s``),
and ``ProcessGroup.abort()`` does nothing for gloo. A doorway given an *alarm* (a callable that
returns why the group is known to have failed, or None) does not block in the backend: it waits
on the work's future in short slices and asks the alarm between them, at most every
``POLL_S``, and only once the work has been pending longer than ``GRACE_S`` (an undisturbed
collective that completes within that costs no alarm call). On an alarm it raises
:class:`Abandoned` (a :class:`PeerLost`, handled as a closed connection is). The abandoned work
is never waited on again (a gloo ``wait`` given a short timeout that expires would fail the
work, so none is used while the alarm is quiet), and it is still pending in the backend: the
last reference to its group must not be dropped while it is, since gloo's group then joins its
worker threads, which wait for the work until the peers close their sockets or the group's
timeout (measured: a regroup held 59 s by it under ``comm.timeout_s = 60``). Whoever abandons
a group keeps it until the process exits (``recovery/injob.py``).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

from longboat.comm.errors import PeerLost

#: How often a pending wait asks the alarm (one store read per ask under in-job recovery).
POLL_S = 0.15
#: How long a collective may be pending before its wait asks the alarm at all.
GRACE_S = 0.005

Alarm = Callable[[], "str | None"]


class Abandoned(PeerLost):
    """A wait given up on an alarm: its work is still pending in the backend, and the group
    it belongs to must outlive it (destroying that group would wait for the work)."""


def wait_watched(work: Any, timeout: datetime.timedelta, alarm: Alarm, what: str) -> Any:
    """``work.wait(timeout)``, unless ``alarm()`` says the group failed before the work
    completed: then :class:`PeerLost`, naming ``what`` and the alarm's reason."""
    if work.is_completed():
        return work.wait(timeout)
    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _f: done.set())
    except (RuntimeError, AttributeError):
        # No future (gloo's reduce_scatter), and its is_completed() stays False even once the
        # work is over (torch 2.13): polling it waited out the whole timeout on every stage-1
        # reduce-scatter (10 s a step at comm.timeout_s = 10). A thread waits in the backend
        # and says when that returned; the wait below then returns at once, or raises.
        threading.Thread(target=_wait_then_set, args=(work, done), daemon=True).start()
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    ask_at = start + GRACE_S
    while not done.is_set() and not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            break
        if now >= ask_at:
            reason = alarm()
            if reason is not None:
                raise Abandoned(
                    f"{what} abandoned after {now - start:.2f} s: {reason} (learned from the "
                    "store, not from this rank's connections; [Note: watched waits])"
                )
            ask_at = now + POLL_S
        done.wait(min(ask_at - now, deadline - now))
    left = max(deadline - time.monotonic(), 0.001)
    return work.wait(datetime.timedelta(seconds=left))


def _wait_then_set(work: Any, done: threading.Event) -> None:
    """Wait for ``work`` in the backend (until it ends, at the latest at its group's timeout),
    then set ``done``; a failure is left to the caller's own wait, which raises it."""
    try:
        work.wait()
    except Exception:  # raised again by the caller's own wait
        pass
    finally:
        done.set()


__all__ = ["GRACE_S", "POLL_S", "Abandoned", "Alarm", "wait_watched"]
