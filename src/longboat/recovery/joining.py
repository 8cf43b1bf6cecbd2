"""A replacement rank is taken into a running job at a step boundary, through the launcher's store.

[Note: joining a replacement] When a rank dies under in-job recovery and ``longboat run`` has a
replacement left (``--max-restarts``), it starts the script again in the dead rank's place
([Note: keeping survivors] in ``launch/survivors.py``), with ``LONGBOAT_REPLACEMENT_ID`` set
to a new id (launch rank + world size x replacements of that rank so far: ids never repeat, so
the launcher's record of the old process's death never stands for the new one). The new
process reads no checkpoint. It builds its engine alone, then:

1. takes the next *ticket* ``k`` (``add`` on ``longboat/recovery/tickets``) and writes
   ``longboat/recovery/join/<k>`` = ``waiting`` (and its id beside it);
2. the members look at ticket ``joined + 1`` once per step, after the step completed: one
   ``compare_set(key, "waiting", <step + 1>)``, a single store round trip. Absent, the store
   hands back the expected value and nothing happens. The first member that finds the
   ticket waiting turns it into a step: the joiner is taken in after step ``step + 1``. Every
   other member reads that step at its next boundary, and is then still before or at it: a
   replica cannot complete step ``s + 1`` before every other has finished step ``s`` (its
   reduction waits for them), so members are at most one step apart. Until that step only
   the member's own counter is compared, no store read;
3. at that boundary the members agree on the next generation as after a loss ([Note:
   membership]) with the joiner appended last, so the ranks that were there keep their
   order; a member lost meanwhile is left out as usual. They write the generation under
   ``join/<k>/generation`` and join its group; the joiner, polling for that key, joins too;
4. the lowest member (new rank 0) broadcasts what the joiner needs ([Note: what a joiner
   receives] in ``transfer.py``); from the next step on every rank holds the same state and
   the loaders deal over the whole group again.

A joiner started while the members are still regrouping after the loss writes its ticket all
the same; the members see it at the first boundary after their regroup. One joiner is taken in
per boundary; a second ticket waits for the next. A joiner whose job ended before it was taken
in (each member's process marks ``longboat/recovery/closed/<id>`` as it exits), or whose
members all died, stops, saying so, rather than wait forever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from longboat.recovery.membership import ROOT, RecoveryError

TICKETS = f"{ROOT}/tickets"
CLOSED = f"{ROOT}/closed"  # closed/<id>: that member's process ended (no more boundaries)
CURRENT = f"{ROOT}/current"  # the ids of the latest generation (a joiner checks them alive)
WAITING = "waiting"


class JobEnded(SystemExit):
    """The job finished before this replacement was taken in: nothing is left to do (exit 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message


def _ticket(k: int) -> str:
    return f"{ROOT}/join/{k}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def register(store: Any, id: int) -> int:
    """Take the next ticket for the joiner ``id`` and mark it waiting; returns the ticket."""
    k = int(store.add(TICKETS, 1))
    store.set(f"{_ticket(k)}/id", str(id))
    store.set(_ticket(k), WAITING)  # last: a member that sees it finds the id already there
    return k


def at_boundary(store: Any, k: int, step: int) -> int | None:
    """On a member, once step ``step`` completed: the step after which ticket ``k``'s joiner is
    taken in, or None when none waits. One store round trip ([Note: joining a replacement])."""
    got = _text(store.compare_set(_ticket(k), WAITING, json.dumps(step + 1)))
    if got == WAITING:  # absent: compare_set hands the expected value back
        return None
    return int(json.loads(got))


def joiner_of(store: Any, k: int) -> int:
    """The id of ticket ``k``'s joiner."""
    return int(_text(store.get(f"{_ticket(k)}/id")))


def admitted(store: Any, k: int, generation: int, members: Sequence[int]) -> None:
    """Tell ticket ``k``'s joiner (and any later one) which generation it is in."""
    store.set(CURRENT, json.dumps(list(members)))
    store.set(f"{_ticket(k)}/generation", str(generation))


def current(store: Any, members: Sequence[int]) -> None:
    """Record the latest generation's ids (for a joiner that waits)."""
    store.set(CURRENT, json.dumps(list(members)))


def close(store: Any, id: int) -> None:
    """Member ``id`` takes no more steps (its process ends)."""
    store.set(f"{CLOSED}/{id}", "1")


def wait_admitted(
    store: Any,
    k: int,
    *,
    dead: Callable[[], set[int]] = set,
    poll_s: float = 0.05,
) -> int:
    """The generation ticket ``k``'s joiner is taken into. Raises :class:`JobEnded` when the
    job finished first, :class:`RecoveryError` when every member died first."""
    key = f"{_ticket(k)}/generation"
    while not store.check([key]):
        if store.check([CURRENT]):
            members = [int(i) for i in json.loads(_text(store.get(CURRENT)))]
            gone = dead()
            ended = [i for i in members if i not in gone and store.check([f"{CLOSED}/{i}"])]
            if members and all(i in gone for i in members):
                raise RecoveryError(
                    f"every member of the job (ids {members}) died before replacement "
                    f"ticket {k} was taken in: no live peer holds the state to join from"
                )
            if members and all(i in gone or i in ended for i in members):
                raise JobEnded(
                    f"the job finished before replacement ticket {k} was taken in; nothing to do"
                )
        time.sleep(poll_s)
    return int(_text(store.get(key)))


__all__ = [
    "JobEnded",
    "admitted",
    "at_boundary",
    "close",
    "current",
    "joiner_of",
    "register",
    "wait_admitted",
]
