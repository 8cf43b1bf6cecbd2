"""The asynchronous operations a rank has issued on one process set and not yet started.

[Note: Horovod pending operations] Horovod's coordinator matches asynchronous operations by
name: ``allreduce_async(a, name="x"); allreduce_async(b, name="y")`` on one rank and ``y``
before ``x`` on another both complete, because each reduction starts once every rank has
submitted its name, in an order the coordinator picks. Here an asynchronous allreduce is not
started when it is issued: it waits in its process set's :class:`Queue` (an unnamed one gets
Horovod's kind of name, ``allreduce.noname.<n>``, so unnamed ones still pair up in issue
order). Every round of [Note: Horovod negotiation] (negotiate.py) carries each rank's queue,
and the operations every active rank has are started in one agreed order, the same on every
rank, so the data plane sees the same sequence of collectives everywhere. Rounds happen where
a rank calls in: every blocking collective (its round starts what is common, then runs it),
``synchronize`` (rounds until its operation has started, or an error when every rank waits and
nothing can run), and ``poll``, which starts a round and finishes it at a later call once every
rank's part of it has arrived (the headers, then the offers when they differ), so it never
waits for peers that have not called in. Ranks that issue the same
operations in the same order still pay one header exchange per round; the price of matching
by name is that a reduction starts at the first ``synchronize``, ``poll`` or blocking
collective after it was issued, not at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from longboat.horovod.negotiate import Gathering, HorovodInternalError, Offer, Request, Round


@dataclass(eq=False)
class Entry:
    """One operation in a queue: ``start`` launches it when a round agrees on it."""

    request: Request
    start: Callable[[], None]
    started: bool = False
    error: HorovodInternalError | None = None  # the ranks' requests for its name differed

    @property
    def settled(self) -> bool:
        return self.started or self.error is not None


class Queue:
    """One process set's operations not yet started, and the round under way from a ``poll``
    ([Note: Horovod pending operations]). ``group`` and ``size`` in each call: the set's
    control group and size."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._unnamed = itertools.count()
        self._inflight: Gathering | None = None

    def add(self, request: Request, start: Callable[[], None], what: str) -> Entry:
        """Queue ``request`` (named, or given the next ``<op>.noname.<n>``)."""
        name = request.name or f"{request.op}.noname.{next(self._unnamed)}"
        if any(e.request.name == name for e in self.entries):
            me = dist.get_rank() if dist.is_initialized() else 0
            raise ValueError(
                f"hvd.{what}: an operation named {name!r} is already pending on rank {me}; "
                "synchronize it first or give this one another name"
            )
        entry = Entry(replace(request, name=name), start)
        self.entries.append(entry)
        return entry

    def _apply(self, r: Round) -> Round:
        """Start what ``r`` agreed on, in its order; fail what it found mismatched."""
        by_name = {e.request.name: e for e in self.entries}
        for name, error in r.failed.items():
            by_name[name].error = error
        for q in r.started:
            by_name[q.name].started = True
        self.entries = [e for e in self.entries if not e.settled]
        for q in r.started:
            by_name[q.name].start()
        return r

    def _settle(self) -> None:
        """Finish the round a ``poll`` left under way."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            r = self._apply(inflight.finish())
            # A poll does not wait, so no round it took part in can stall, and it is in no
            # collective of its own to disagree about.
            assert r.error is None, r.error

    def round(
        self,
        group: dist.ProcessGroup | None,
        size: int,
        now: Request | None = None,
        waits_for: str = "",
        active: bool = True,
        fresh: bool = False,
    ) -> Round:
        """One blocking round; ``active=False``: this rank is in ``hvd.join()``."""
        self._settle()
        pending = tuple(e.request for e in self.entries)
        offer = Offer(now, pending, waits_for or (now.name if now else "")) if active else None
        r = Gathering(offer, group, size, fresh).finish()
        if active:  # a joined rank offered nothing: the round starts none of its own
            self._apply(r)
        if r.error is not None:
            raise r.error
        return r

    def announce(self, now: Request, group: dist.ProcessGroup | None, size: int) -> Round:
        """Rounds until every active rank is in ``now``; returns the round that runs it."""
        while True:
            r = self.round(group, size, now)
            if r.now is not None:
                return r

    def synchronize(self, entry: Entry, group: dist.ProcessGroup | None, size: int) -> None:
        """Rounds until ``entry`` has started; raises its error if its requests differed."""
        self._settle()  # a poll's round may have started it: no round of its own then
        while not entry.settled:
            self.round(group, size, waits_for=entry.request.name)
        if entry.error is not None:
            raise entry.error

    def poll(self, entry: Entry, group: dist.ProcessGroup | None, size: int) -> bool:
        """Whether ``entry`` has started (or failed), going on with rounds without waiting."""
        if self._inflight is not None and not self._inflight.done():
            return False
        self._settle()
        if not entry.settled:
            pending = tuple(e.request for e in self.entries)
            offer = Offer(None, pending, entry.request.name, blocking=False)
            self._inflight = Gathering(offer, group, size)
        return entry.settled


__all__ = ["Entry", "Queue"]
