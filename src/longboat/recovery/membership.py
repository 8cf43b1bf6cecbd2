"""The survivors' agreement on who goes on, through the launcher's store.

[Note: membership] When a collective fails or times out, each survivor of generation ``g``
writes what it holds under ``longboat/recovery/<g+1>/here/<id>`` (``id``: its global rank at
launch, which never changes, so that generations can renumber ranks freely): the step it is
about to redo and where its loaders stood at the start of that step. Then it waits until every
member of generation ``g`` has either arrived or is known dead (the launcher on this node writes
the ranks it saw die, [Note: rank roles] in ``longboat/roles.py``), or until
``recovery.wait_s`` has passed. It then proposes the members that arrived, with
``compare_set`` on ``longboat/recovery/<g+1>/members``: the store keeps the first proposal and
hands it to every later one, so every survivor reads the same membership, however their views
of who had arrived differed. A survivor that arrives after that, and is not in it, is told so
and stops (the launcher then drops it too).

The members' new ranks are their positions in the membership (in the order of their old
ranks). Where a replica is held by several ranks together (``block`` > 1: the shard group of
hybrid sharding, [Note: hybrid sharding] in ``strategies/zero/strategy.py``), the members go on
in whole blocks: a block that lost a rank is left out, its survivors with it (they hold shards
of a replica that is incomplete; :class:`Left` tells each so, and its launcher replaces it),
and the blocks that stay keep their order, so every member keeps its place within its block
(its shard).

Every member must be at the same step and loader position: replicas that stepped in lockstep
are, unless one of them finished the failed step's reduction and the optimizer step
before the others lost the peer. Bringing such a replica back in line (state from a live peer)
is not built yet: the disagreement is refused with the steps of each rank.

Pure except for the store (anything with torch's ``Store`` methods ``set``, ``get``, ``check``
and ``compare_set``): ``tests/test_recovery_membership.py`` runs it on a ``HashStore`` with
threads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = "longboat/recovery"


class RecoveryError(RuntimeError):
    """The survivors could not agree on how to go on; the message says why and names ranks."""


#: The exit status of a survivor that left its incomplete replica (:class:`Left`): the
#: launcher starts a replacement in its place, as for a dead rank, while ``--max-restarts``
#: allows, so that the replica can be taken in again whole (EX_TEMPFAIL).
LEFT_STATUS = 75


class Left(SystemExit):
    """This survivor is not among the members that go on: its replica's block lost a rank
    ([Note: membership]). Its process ends with :data:`LEFT_STATUS`, ``message`` saying why."""

    def __init__(self, message: str) -> None:
        super().__init__(LEFT_STATUS)
        self.message = message


@dataclass(frozen=True)
class Arrival:
    """What one survivor holds: its id (global rank at launch), the step it redoes and where
    each of its loaders stood at that step's start (``[epoch, samples]``, one per loader)."""

    id: int
    step: int
    loaders: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "step": self.step, "loaders": self.loaders})

    @classmethod
    def from_json(cls, text: str | bytes) -> Arrival:
        d = json.loads(text)
        return cls(int(d["id"]), int(d["step"]), tuple((int(e), int(s)) for e, s in d["loaders"]))


@dataclass(frozen=True)
class Membership:
    """Generation ``generation``: its members' ids in rank order, and what it resumes."""

    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...]  # ids of the previous generation that did not go on
    step: int
    loaders: tuple[tuple[int, int], ...]

    def rank_of(self, id: int) -> int:
        """The new rank of member ``id``."""
        return self.members.index(id)


def agree(
    store: Any,
    generation: int,
    previous: Sequence[int],
    mine: Arrival,
    *,
    wait_s: float,
    dead: Callable[[], set[int]] = set,
    poll_s: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    joining: Sequence[int] = (),
    block: int = 1,
) -> Membership:
    """Agree with the other survivors of ``previous`` (the ids of the generation before) on
    generation ``generation`` ([Note: membership]). ``dead()``: ids known dead. ``joining``:
    the ids of replacements taken in, after the members that arrived ([Note: joining a
    replacement] in ``joining.py``); they write no arrival of their own. ``block``: how many
    consecutive members hold one replica together; only whole blocks go on. Raises
    :class:`Left` in a survivor whose block lost a rank."""
    blocks = [tuple(previous[i : i + block]) for i in range(0, len(previous), block)]
    base = f"{ROOT}/{generation}"
    store.set(f"{base}/here/{mine.id}", mine.to_json())
    decided = f"{base}/members"
    deadline = clock() + wait_s
    while not store.check([decided]):
        arrived = [i for i in previous if store.check([f"{base}/here/{i}"])]
        gone = dead()
        if all(i in arrived or i in gone for i in previous) or clock() >= deadline:
            whole = [i for b in blocks if all(i in arrived for i in b) for i in b]
            store.compare_set(decided, "", json.dumps([*whole, *joining]))
            break
        time.sleep(poll_s)
    members = tuple(int(i) for i in json.loads(store.get(decided)))
    if not members:
        raise RecoveryError(
            f"no replica survived whole into generation {generation}: every block of {block} "
            f"ranks holding one (ids {[list(b) for b in blocks]}) lost a rank; restart from a "
            "checkpoint (longboat run --max-restarts)"
        )
    mates = next((b for b in blocks if mine.id in b), ())
    out = mine.id not in members and block > 1
    missing = [i for i in mates if not store.check([f"{base}/here/{i}"])] if out else []
    if missing:
        raise Left(
            f"rank {mine.id} (id at launch) leaves: the {block} ranks holding its replica "
            f"together (ids {list(mates)}) lost {', '.join(map(str, missing))}, so its shards "
            f"are of an incomplete replica; generation {generation} goes on with ids "
            f"{list(members)}"
        )
    if mine.id not in members:
        raise RecoveryError(
            f"rank {mine.id} (id at launch) arrived after generation {generation} was agreed "
            f"without it (members {list(members)}); raise recovery.wait_s if the survivors "
            "notice a failure further apart than that"
        )
    here = [i for i in members if i not in joining]
    arrivals = [Arrival.from_json(store.get(f"{base}/here/{i}")) for i in here]
    where = {(a.step, a.loaders) for a in arrivals}
    if len(where) > 1:
        said = "; ".join(f"rank {a.id}: step {a.step}, loaders {list(a.loaders)}" for a in arrivals)
        raise RecoveryError(
            f"the survivors of generation {generation - 1} stand at different steps or data "
            f"positions ({said}): one finished the failed step before the others lost the "
            "peer, and bringing a replica back in line from a live peer is not built yet; "
            "restart from a checkpoint (longboat run --max-restarts)"
        )
    lost = tuple(i for i in previous if i not in members)
    return Membership(generation, members, lost, mine.step, mine.loaders)


DEATHS = f"{ROOT}/dead"


def publish_death(store: Any, id: int) -> None:
    """The launcher's notice, in the job's store, that the process of ``id`` died: survivors on
    other nodes see it ([Note: deaths across nodes])."""
    n = store.add(f"{DEATHS}/count", 1)
    store.set(f"{DEATHS}/{n}", str(id))


class DeathNotices:
    """The ids the launchers published dead in the store, read in order (one ``check`` a call
    when there is nothing new), with ``local()``'s (this node's launcher's records) added.

    Note [deaths across nodes]: only the launcher of the node a rank ran on sees it die. Its
    records on that node's disk tell the survivors there; a survivor on another node would
    not know, and where no survivor shares the lost rank's node (the rank was alone on it)
    the agreement waited for it until ``recovery.wait_s`` (measured: 10.0 s at wait_s = 10,
    two namespace hosts of 2 + 1 ranks). So each launcher also publishes the deaths it
    records in the job's store, as a list (``<DEATHS>/count`` numbers the notices, notice
    ``n`` is under ``<DEATHS>/<n>``). A node lost whole, its launcher with it, publishes
    nothing: its ranks are waited for until ``recovery.wait_s``."""

    def __init__(self, store: Any, local: Callable[[], set[int]] = set) -> None:
        self._store, self._local = store, local
        self._known: set[int] = set()
        self._read = 0  # notices read so far

    def __call__(self) -> set[int]:
        while self._store.check([f"{DEATHS}/{self._read + 1}"]):
            self._read += 1
            self._known.add(int(self._store.get(f"{DEATHS}/{self._read}")))
        return self._known | self._local()


__all__ = [
    "DEATHS",
    "LEFT_STATUS",
    "ROOT",
    "Arrival",
    "DeathNotices",
    "Left",
    "Membership",
    "RecoveryError",
    "agree",
    "publish_death",
]
