"""Horovod's process sets: collectives among a subset of the ranks.

[Note: Horovod process sets] ``hvd.add_process_set([0, 2])``, called by every rank in the same
order (as Horovod requires), makes a group of those ranks for the data and, when the default
group is not gloo, a gloo group for the exchange of [Note: Horovod negotiation]; a collective
given ``process_set=`` then runs, and is checked, among its ranks only. Ranks keep their global
numbers: a broadcast's ``root_rank`` is the root's global rank, as in Horovod; ``size()`` and
``rank()`` of a set count within it. ``hvd.join()`` follows the global set's collectives only.

Each set keeps its own groups, the global set (``hvd.global_process_set``, a module-level object
in Horovod too) included: under gloo its control group is the default group itself; otherwise a
gloo group over every rank, made on the first exchange that needs it (a round every rank
reaches) and remade when the default group is a new one (``hvd.init()`` after
``hvd.shutdown()``). No other module keeps a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from longboat.horovod import negotiate
from longboat.horovod.pending import Queue


class ProcessSet:
    """The ranks a collective runs among; ``ProcessSet()`` (``hvd.global_process_set``) is
    every rank."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.group: dist.ProcessGroup | None = None
        self.control: dist.ProcessGroup | None = None
        # The global set's: the default group its control group was made over.
        self._made_over: dist.ProcessGroup | None = None
        self.queue = Queue()  # [Note: Horovod pending operations] in pending.py

    def members(self) -> list[int]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return list(range(world)) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self.members())

    def rank(self) -> int:
        """This rank's index in the set, or -1 when it is not a member."""
        me = dist.get_rank() if dist.is_initialized() else 0
        members = self.members()
        return members.index(me) if me in members else -1

    def included(self) -> bool:
        return self.rank() >= 0

    def global_control(self) -> dist.ProcessGroup | None:
        """The global set's control group (None: the default group, under gloo), made on first
        use over the current default group ([Note: Horovod process sets])."""
        assert self.ranks is None, self
        if dist.get_backend() == "gloo":
            return None
        world = dist.group.WORLD
        if self.control is None or self._made_over is not world:
            self.control, self._made_over = dist.new_group(backend="gloo"), world
        return self.control

    def forget(self) -> None:
        """Drop the global set's control group and queue, before ``hvd.shutdown()`` destroys
        the default group (which destroys every group made over it)."""
        assert self.ranks is None, self
        self.control = self._made_over = None
        self.queue = Queue()

    def __repr__(self) -> str:
        return f"ProcessSet({'all' if self.ranks is None else self.ranks})"


global_process_set = ProcessSet()


@dataclass(frozen=True)
class Where:
    """Where a collective runs: its data group and control group (None: the default ones),
    and the queue of its process set ([Note: Horovod pending operations] in pending.py)."""

    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    size: int
    rank: int
    is_global: bool
    queue: Queue


def where(process_set: ProcessSet | None, what: str) -> Where:
    """The groups ``process_set`` runs ``what`` on; raises naming the set when this rank is not
    in it or it was never added."""
    ps = process_set or global_process_set
    if ps.ranks is None:
        world = dist.is_initialized()
        return Where(
            None,
            ps.global_control() if world and dist.get_world_size() > 1 else None,
            ps.size(),
            ps.rank(),
            True,
            ps.queue,
        )
    if not ps.included():
        raise ValueError(f"hvd.{what}: rank {dist.get_rank()} is not in {ps}; call it on its ranks")
    if ps.group is None:
        raise ValueError(f"hvd.{what}: {ps} was not added; call hvd.add_process_set first")
    return Where(ps.group, ps.control, ps.size(), ps.rank(), False, ps.queue)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Make ``process_set`` (or a set of these global ranks) usable; every rank must call this,
    in the same order ([Note: Horovod process sets]). Ranks that disagree on the set raise."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ps.ranks is None:
        raise ValueError("add_process_set: the global process set exists already")
    bad = [r for r in ps.ranks if not 0 <= r < world]
    if not ps.ranks or bad:
        raise ValueError(f"add_process_set: ranks {ps.ranks} must be non-empty, 0 to {world - 1}")
    if world > 1:
        everyone = where(None, "add_process_set")
        mine = negotiate.request("add_process_set", name=str(ps.ranks))
        everyone.queue.announce(mine, everyone.control, everyone.size)
        ps.group = dist.new_group(ps.ranks)
        gloo = dist.get_backend() == "gloo"
        ps.control = ps.group if gloo else dist.new_group(ps.ranks, backend="gloo")
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Free ``process_set``'s groups (every rank, in the same order); False if it had none."""
    if process_set.group is None:
        return False
    groups = {id(g): g for g in (process_set.group, process_set.control) if g is not None}
    if process_set.included():
        for g in groups.values():
            dist.destroy_process_group(g)
    process_set.group = process_set.control = None
    process_set.queue = Queue()
    return True
