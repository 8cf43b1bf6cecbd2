"""What a rank is in its job, told to the launcher that started it.

[Note: rank roles] ``longboat run`` gives its workers a directory (``LONGBOAT_ROLES_DIR``). A
rank whose role matters to the launcher writes ``rank<global rank>.json`` there: words for the
launcher's reports ("parameter server 0") and whether the job goes on without it
(``droppable``: an async or ssp parameter-server worker, which the servers drop when it dies; a
replica under in-job recovery, which the survivors regroup without), with ``after`` saying what
happens then. Outside ``longboat run`` nothing is written. A rank that dies before it wrote its
file is an ordinary rank: its death stops the job. When the launcher drops a rank it writes
``dead<id>.json`` beside the roles (``id``: the global rank, or a replacement's id,
``REPLACEMENT_ENV``), so the ranks on its node need not wait to learn
of the death ([Note: membership] in ``longboat/recovery/membership.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "LONGBOAT_ROLES_DIR"
# Set by ``longboat run`` in a process it started in place of a dead replica: the new process's
# id ([Note: joining a replacement] in ``longboat/recovery/joining.py``).
REPLACEMENT_ENV = "LONGBOAT_REPLACEMENT_ID"


@dataclass(frozen=True)
class Role:
    """One rank's role: ``what`` it is, in words, and whether the job survives its death."""

    what: str
    droppable: bool = False
    after: str = "the servers drop it"  # what happens when a droppable rank dies, in words
    # The launcher may start a new process in its place (a replica under in-job recovery,
    # which joins from a live peer), within its budget of --max-restarts.
    replaceable: bool = False


def announce(rank: int, role: Role) -> None:
    """Tell the launcher (if it asked, see [Note: rank roles]) what global rank ``rank`` is."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    path = Path(directory, f"rank{rank}.json")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(role)))
    tmp.replace(path)  # whole or absent: the launcher may read it at any moment


def read(directory: Path) -> dict[int, Role]:
    """The roles the ranks announced in ``directory``, by global rank."""
    out: dict[int, Role] = {}
    for path in directory.glob("rank*.json"):
        try:
            out[int(path.stem.removeprefix("rank"))] = Role(**json.loads(path.read_text()))
        except (ValueError, TypeError, OSError):
            continue  # not one of ours
    return out


def mark_dead(directory: Path, rank: int, how: str) -> None:
    """The launcher's record that the process of id ``rank`` died (``how``, in words)."""
    path = Path(directory, f"dead{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "how": how}))
    tmp.replace(path)


def dead() -> set[int]:
    """The global ranks the launcher that started this process saw die (none outside
    ``longboat run``)."""
    directory = os.environ.get(ENV)
    if not directory:
        return set()
    out: set[int] = set()
    for path in Path(directory).glob("dead*.json"):
        try:
            out.add(int(path.stem.removeprefix("dead")))
        except ValueError:
            continue  # not one of ours
    return out


__all__ = ["ENV", "REPLACEMENT_ENV", "Role", "announce", "dead", "mark_dead", "read"]
