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

Under hybrid sharding a replica is held by its shard group together ([Note: membership] in
``membership.py``), so replacements come in as whole shard groups, a *batch* of ``block``
joiners, one for each place in the group (its launch rank's place, ``rank % block``): each
takes a ticket with its place (``join/<k>/place``); the tickets, in order, fill batches, each
ticket the first batch still lacking its place (the same batches on every joiner, whatever
it reads when). Once its batch is whole, a joiner writes the batch's tickets
(``batch/<b>/tickets``), builds its engine together with the others of its batch, as a
shard group of its own (a group under ``batch/<b>/group/``: ZeRO lays out each shard for
its place), and counts itself built; the last one marks ``batch/<b>`` waiting. The members
then take batch ``joined + 1`` in as they take a ticket in above, its joiners appended in
the order of their places, so they make one whole replica, each at its place.

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


def _batch(b: int) -> str:
    return f"{ROOT}/batch/{b}"


def waiting_key(n: int, block: int) -> str:
    """What the members look at for the ``n``-th joining: ticket ``n`` one by one, batch ``n``
    when replicas are held by ``block`` > 1 ranks together."""
    return _ticket(n) if block == 1 else _batch(n)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def register(store: Any, id: int) -> int:
    """Take the next ticket for the joiner ``id`` and mark it waiting; returns the ticket."""
    k = int(store.add(TICKETS, 1))
    store.set(f"{_ticket(k)}/id", str(id))
    store.set(_ticket(k), WAITING)  # last: a member that sees it finds the id already there
    return k


def at_boundary(store: Any, key: str, step: int) -> int | None:
    """On a member, once step ``step`` completed: the step after which the joining under
    ``key`` (:func:`waiting_key`) is taken in, or None when none waits. One store round trip
    ([Note: joining a replacement])."""
    got = _text(store.compare_set(key, WAITING, json.dumps(step + 1)))
    if got == WAITING:  # absent: compare_set hands the expected value back
        return None
    return int(json.loads(got))


def joiner_of(store: Any, k: int) -> int:
    """The id of ticket ``k``'s joiner."""
    return int(_text(store.get(f"{_ticket(k)}/id")))


def joiners_of(store: Any, n: int, block: int) -> list[tuple[int, int]]:
    """The ``n``-th joining's (ticket, id) pairs, in the order of their places."""
    if block == 1:
        return [(n, joiner_of(store, n))]
    tickets = [int(k) for k in json.loads(_text(store.get(f"{_batch(n)}/tickets")))]
    return [(k, joiner_of(store, k)) for k in tickets]


def form_batch(
    store: Any,
    id: int,
    place: int,
    block: int,
    *,
    dead: Callable[[], set[int]] = set,
    poll_s: float = 0.05,
) -> tuple[int, int, list[int]]:
    """Take a ticket for joiner ``id`` at ``place`` of a shard group of ``block`` and wait until
    its batch is whole ([Note: joining a replacement]). Returns the ticket, the batch's number
    and its tickets in the order of their places. Raises as :func:`wait_admitted` does when
    the job ends or its members all die first."""
    k = int(store.add(TICKETS, 1))
    store.set(f"{_ticket(k)}/id", str(id))
    store.set(f"{_ticket(k)}/place", str(place))
    places: dict[int, int] = {}  # ticket -> place, read once each
    while True:
        batches: list[dict[int, int]] = []  # place -> ticket, in ticket order
        for t in range(1, int(store.add(TICKETS, 0)) + 1):
            if t not in places:  # taken already: its place follows at once
                places[t] = int(_text(store.get(f"{_ticket(t)}/place")))
            p = places[t]
            into = next((b for b in batches if p not in b), None)
            if into is None:
                batches.append(into := {})
            into[p] = t
        b = next(i for i, got in enumerate(batches) if k in got.values())
        if len(batches[b]) == block:
            tickets = [batches[b][p] for p in range(block)]
            store.set(f"{_batch(b + 1)}/tickets", json.dumps(tickets))
            return k, b + 1, tickets
        _ended(store, f"replacement ticket {k}", dead)
        time.sleep(poll_s)


def built(store: Any, b: int, block: int) -> None:
    """One joiner of batch ``b`` has built its engine; the last marks the batch waiting."""
    if int(store.add(f"{_batch(b)}/built", 1)) == block:
        store.set(_batch(b), WAITING)


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
        _ended(store, f"replacement ticket {k}", dead)
        time.sleep(poll_s)
    return int(_text(store.get(key)))


def _ended(store: Any, who: str, dead: Callable[[], set[int]]) -> None:
    """Raise :class:`JobEnded` when every member of the latest generation finished or died,
    :class:`RecoveryError` when they all died: ``who`` will not be taken in."""
    if not store.check([CURRENT]):
        return
    members = [int(i) for i in json.loads(_text(store.get(CURRENT)))]
    gone = dead()
    ended = [i for i in members if i not in gone and store.check([f"{CLOSED}/{i}"])]
    if members and all(i in gone for i in members):
        raise RecoveryError(
            f"every member of the job (ids {members}) died before {who} was taken in: no "
            "live peer holds the state to join from"
        )
    if members and all(i in gone or i in ended for i in members):
        raise JobEnded(f"the job finished before {who} was taken in; nothing to do")


__all__ = [
    "JobEnded",
    "admitted",
    "at_boundary",
    "built",
    "close",
    "current",
    "form_batch",
    "joiner_of",
    "joiners_of",
    "register",
    "wait_admitted",
    "waiting_key",
]
