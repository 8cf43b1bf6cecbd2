"""The waits of [Note: watched waits] (comm/watched.py) on stand-in works, without processes:
a wait whose work is over asks nothing; a pending one asks the alarm until it speaks, then
gives up as a lost peer; one whose work ends while the alarm is quiet returns its result."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from longboat.comm.errors import PeerLost
from longboat.comm.watched import Abandoned, wait_watched

LONG = datetime.timedelta(seconds=30)  # a deadline only: none of these waits reaches it


class _Future:
    def __init__(self) -> None:
        self._callbacks: list = []
        self.done = False

    def add_done_callback(self, fn) -> None:
        self._callbacks.append(fn)

    def finish(self) -> None:
        self.done = True
        for fn in self._callbacks:
            fn(self)


class _Work:
    """A work that is over once ``finish`` is called (from any thread)."""

    def __init__(self, done: bool = False) -> None:
        self.future = _Future()
        self.future.done = done
        self.waited: list[datetime.timedelta] = []

    def is_completed(self) -> bool:
        return self.future.done

    def get_future(self) -> _Future:
        return self.future

    def wait(self, timeout: datetime.timedelta) -> bool:
        assert self.future.done, "waited on in the backend while still pending"
        self.waited.append(timeout)
        return True


class _Alarm:
    def __init__(self, speaks_at: int | None) -> None:
        self.calls = 0
        self.speaks_at = speaks_at

    def __call__(self) -> str | None:
        self.calls += 1
        return "rank 3 recorded dead" if self.calls == self.speaks_at else None


def test_a_completed_work_costs_no_alarm_call():
    alarm = _Alarm(speaks_at=1)
    assert wait_watched(_Work(done=True), LONG, alarm, "x") is True
    assert alarm.calls == 0


def test_a_pending_work_is_given_up_when_the_alarm_speaks():
    work, alarm = _Work(), _Alarm(speaks_at=2)
    with pytest.raises(Abandoned, match=r"rank 3 recorded dead.*learned from the store") as e:
        wait_watched(work, LONG, alarm, "a collective of group 'world'")
    assert isinstance(e.value, PeerLost)  # handled as a closed connection is
    assert alarm.calls == 2
    assert work.waited == []  # never waited on in the backend


def test_a_work_that_ends_while_the_alarm_is_quiet_returns_its_result():
    work, alarm = _Work(), _Alarm(speaks_at=None)
    threading.Timer(0.4, work.future.finish).start()
    assert wait_watched(work, LONG, alarm, "x") is True
    assert alarm.calls >= 1 and len(work.waited) == 1


class _NoFuture:
    """Like gloo's reduce-scatter work: no future, ``is_completed()`` False even once over;
    ``wait()`` blocks until ``finish``."""

    def __init__(self) -> None:
        self.over = threading.Event()

    def is_completed(self) -> bool:
        return False

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        assert self.over.wait(timeout.total_seconds() if timeout else 30)
        return True


def test_a_work_without_a_future_returns_when_it_ends_not_at_the_deadline():
    # Polling is_completed() waited out the whole timeout: 10 s a step for ZeRO-1 under
    # in-job recovery at comm.timeout_s = 10.
    work, alarm = _NoFuture(), _Alarm(speaks_at=None)
    threading.Timer(0.2, work.over.set).start()
    t0 = time.monotonic()
    assert wait_watched(work, LONG, alarm, "x") is True
    assert time.monotonic() - t0 < LONG.total_seconds() / 2  # a deadline, not a timing


def test_a_work_without_a_future_is_given_up_when_the_alarm_speaks():
    work, alarm = _NoFuture(), _Alarm(speaks_at=2)
    with pytest.raises(Abandoned):
        wait_watched(work, LONG, alarm, "x")
    work.over.set()  # the thread waiting in the backend ends with it
