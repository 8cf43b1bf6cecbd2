"""The process groups of the mesh (:mod:`longboat.mesh`), created once, and a doorway per axis.

For every axis a rank belongs to a group of, the topology holds two doorways
(:class:`~longboat.comm.collectives.Collectives`):

- the *data plane*, on the job's backend (NCCL on GPUs, gloo on CPUs): gradients, parameters,
  anything of the model's, on the model's device;
- the *control plane*, on gloo: small CPU tensors that the CPU must read (desync fingerprints,
  overflow flags, which parameters were used, checkpoint JSON, monitor events, preemption
  votes). NCCL refuses CPU tensors ([Note: NCCL rules] in ``comm/collectives.py``), and keeping
  them off the data groups also keeps them out of the order in which gradients flow.

[Note: group creation] ``torch.distributed.new_group`` is collective over the whole world: every
rank must create every group, members or not, in the same order. The topology does it once, in
the fixed order of :data:`~longboat.mesh.GROUP_AXES` and, within an axis, of the groups' first
ranks; a set of ranks that two axes share (``dp`` and ``world`` in plain data parallelism) gets
one group and one doorway. A group of the whole world uses the default group for its data plane.
Axes of size 1 get a doorway of one rank, whose operations are the identity.

[Note: spread reductions] With ``comm.groups = G`` (> 1), the data-parallel axes (``dp`` and
``dp_shard``) get G - 1 more copies of each of their groups, and strategies ask
:meth:`Topology.reducer` for the doorway of bucket (or unit) ``k``: copy ``k mod G``. Each copy
is a process group of its own (its own NCCL communicator, its own gloo pair of sockets), so the
reductions of consecutive buckets can be on the wire at once instead of queued behind each
other on one communicator (Paddle's ``nccl_comm_num``). With ``comm.hierarchical``, each copy's
sums go in two levels ([Note: hierarchical all-reduce] in ``comm/hierarchical.py``) over groups
within and across nodes, node ``i`` being global ranks ``i * ranks_per_node ..``. These groups are
created after the mesh's, every rank creating all of them, in the order of ``_spread_plan``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.collectives import NCCL_RULES_VAR, Collectives, Rules
from longboat.comm.hierarchical import Hierarchical, node_layout
from longboat.comm.protocol import Comm
from longboat.mesh import GROUP_AXES, Axis, Mesh


@dataclass(frozen=True)
class DoorwayOptions:
    """How every doorway observes its traffic (the config's ``comm`` section)."""

    desync_check: bool = False
    log: bool = False
    log_verbose: bool = False
    timeout_s: float = 1800.0
    #: copies of each data-parallel group that reductions spread over ([Note: spread
    #: reductions])
    groups: int = 1
    #: data-parallel sums in two levels, within and across nodes
    hierarchical: bool = False
    #: consecutive global ranks per node (the world's local world size, or comm.ranks_per_node)
    ranks_per_node: int = 1

    @property
    def spreads(self) -> bool:
        return self.groups > 1 or self.hierarchical


#: The axes whose reductions spread over copies of their groups ([Note: spread reductions]).
SPREAD_AXES: tuple[Axis, ...] = ("dp", "dp_shard")


class Topology:
    """This rank's place on the mesh and a data and a control doorway per axis."""

    def __init__(
        self,
        mesh: Mesh,
        rank: int,
        data: dict[str, Comm],
        control: dict[str, Comm],
        owned: list[dist.ProcessGroup] | None = None,
    ) -> None:
        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self._data = data
        self._control = control
        self._owned = owned or []
        self._extra: list[Comm] = []  # doorways subgroup() and the spread copies made
        # Per spread axis, the doorway of each copy ([Note: spread reductions])
        self._spread: dict[str, list[Comm]] = {}
        self._closed = False
        # What build() made its doorways with, for subgroup() (None: no process group)
        self._options: DoorwayOptions | None = None
        self._rules: tuple[bool, torch.device] = (False, torch.device("cpu"))

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        mesh: Mesh,
        options: DoorwayOptions,
        device: torch.device,
        rules: bool | None = None,
        outside: int = 0,
    ) -> Topology:
        """Create every group of ``mesh`` ([Note: group creation]) and the doorways of this
        rank. Collective: every rank calls it with the same mesh. Without a process group
        (a world of one), every doorway is a group of one. ``outside``: how many ranks at the
        end of the world are not on the mesh (parameter servers); they call
        :meth:`stand_aside` instead."""
        if rules is None:
            rules = os.environ.get(NCCL_RULES_VAR) == "1"
        active = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if active else 1
        rank = dist.get_rank() if active else 0
        if not active and mesh.world_size + outside != 1:
            raise ValueError(
                f"the mesh ({mesh.describe()}) has {mesh.world_size} ranks but there is no "
                "process group"
            )
        created = _create_groups(mesh, options, world, outside) if active else {}
        data: dict[str, Comm] = {}
        control: dict[str, Comm] = {}
        doorways: dict[tuple[int, ...], tuple[Comm, Comm]] = {}
        for axis in GROUP_AXES:
            if mesh.size(axis) == 1 or not active:
                data[axis] = Collectives.alone(rank, name=f"{axis} (one rank)")
                control[axis] = data[axis]
                continue
            mine = mesh.group_of(axis, rank)
            if mine not in doorways:
                g_data, g_ctrl = created[mine]
                name = "world" if len(mine) == world else f"{axis} {list(mine)}"
                doorways[mine] = (
                    _data_doorway(g_data, g_ctrl, options, name, device if rules else None),
                    Collectives(
                        g_ctrl,
                        desync_check=options.desync_check,
                        check_group=g_ctrl,
                        timeout_s=options.timeout_s,
                        name=f"{name}, control",
                        rules=Rules() if rules else None,
                    ),
                )
            data[axis], control[axis] = doorways[mine]
        owned = [g for pair in created.values() for g in pair if g is not None]
        topo = cls(mesh, rank, data, control, owned)
        if active:
            topo._options, topo._rules = options, (rules, device)
            if options.spreads:
                topo._build_spread(device if rules else None)
        return topo

    def _build_spread(self, rules_device: torch.device | None) -> None:
        """The copies of the data-parallel groups and their node levels ([Note: spread
        reductions]); collective over the whole world, like :meth:`build`."""
        assert self._options is not None
        options = self._options
        made: dict[tuple[int, ...], Comm] = {}  # one doorway per set of ranks and copy

        def doorway(ranks: tuple[int, ...], copy: int, what: str) -> Comm:
            key = (*ranks, -1 - copy)
            if key not in made:
                g_data, g_ctrl = created[key]
                made[key] = _data_doorway(
                    g_data, g_ctrl, options, f"{what} {list(ranks)} copy {copy}", rules_device
                )
                self._extra.append(made[key])
            return made[key]

        created = _create_spread(self.mesh, options, self._owned)
        for axis in SPREAD_AXES:
            mine = self.mesh.group_of(axis, self.rank)
            if len(mine) == 1:
                continue
            copies: list[Comm] = []
            for copy in range(options.groups):
                flat = self._data[axis] if copy == 0 else doorway(mine, copy, axis)
                if options.hierarchical:
                    intra, inter = node_layout(mine, options.ranks_per_node)
                    here = next(tuple(g) for g in intra if self.rank in g)
                    across = next(tuple(g) for g in inter if self.rank in g)
                    flat = Hierarchical(
                        flat,
                        doorway(here, copy, "within node") if len(here) > 1 else _one(self.rank),
                        doorway(across, copy, "across nodes")
                        if len(across) > 1
                        else _one(self.rank),
                    )
                copies.append(flat)
            self._spread[axis] = copies

    @staticmethod
    def stand_aside(mesh: Mesh, options: DoorwayOptions, outside: int) -> None:
        """What a rank outside the mesh (one of the last ``outside`` of the world) does while
        the mesh's ranks call :meth:`build`: take part in making their groups."""
        owned: list[Any] = []
        _create_groups(mesh, options, dist.get_world_size(), outside)
        if options.spreads:  # their groups are collective over the whole world too
            _create_spread(mesh, options, owned)

    def subgroup(self, axis: Axis, positions: Sequence[int], name: str) -> Comm:
        """A data-plane doorway over the members at group ranks ``positions`` of this rank's
        group along ``axis`` (e.g. the pipeline stages that hold a tied weight). Collective over
        the whole world, like :meth:`build` ([Note: group creation]): every rank creates the
        subgroup of every group along ``axis``, in order. A rank outside it, or a subgroup of one
        rank, gets a doorway of one."""
        positions = sorted(set(positions))
        alone = Collectives.alone(self.rank, name=f"{name} (one rank)")
        if len(positions) < 2 or self._options is None:
            return alone
        options, (rules, device) = self._options, self._rules
        timeout = datetime.timedelta(seconds=options.timeout_s)
        mine: Comm = alone
        for ranks in self.mesh.groups(axis):
            members = [ranks[i] for i in positions]
            g_data = dist.new_group(members, timeout=timeout)
            g_ctrl = dist.new_group(members, backend="gloo", timeout=timeout)
            self._owned += [g_data, g_ctrl]
            if self.rank in members:
                mine = _data_doorway(
                    g_data, g_ctrl, options, f"{name} {members}", device if rules else None
                )
                self._extra.append(mine)
        return mine

    @classmethod
    def of(
        cls,
        mesh: Mesh,
        rank: int,
        doorway: Callable[[int, int, Axis], Comm],
        control: Callable[[], Comm] | None = None,
    ) -> Topology:
        """A topology whose doorways ``doorway(group_size, rank_in_group, axis)`` makes, one per
        axis (the planner's meta run); its control planes are ``control()``, or the data
        planes."""
        data: dict[str, Comm] = {}
        for axis in GROUP_AXES:
            group = mesh.group_of(axis, rank)
            data[axis] = doorway(len(group), group.index(rank), axis)
        ctrl = {axis: control() for axis in data} if control is not None else dict(data)
        return cls(mesh, rank, data, ctrl)

    # -- what strategies and the engine use ----------------------------------------------------

    @property
    def options(self) -> DoorwayOptions | None:
        """What :meth:`build` made the doorways with (None: no process group)."""
        return self._options

    def data(self, axis: Axis) -> Comm:
        """The data-plane doorway of this rank's group along ``axis``."""
        return self._data[axis]

    def reducer(self, axis: Axis, k: int) -> Comm:
        """The data-plane doorway along ``axis`` that reduction number ``k`` (a bucket, a
        unit) goes through: copy ``k mod comm.groups`` of the axis's group, hierarchical with
        ``comm.hierarchical`` ([Note: spread reductions]); the axis's own doorway otherwise."""
        copies = self._spread.get(axis)
        return copies[k % len(copies)] if copies else self._data[axis]

    def control(self, axis: Axis = "world") -> Comm:
        """The control-plane (gloo, small CPU tensors) doorway along ``axis``."""
        return self._control[axis]

    def pipeline_neighbours(self) -> tuple[int | None, int | None]:
        """Global ranks of the previous and next pipeline stage (None at either end)."""
        return self.mesh.pipeline_neighbours(self.rank)

    @property
    def blocked_seconds(self) -> float:
        """Seconds this rank spent blocked in any of its doorways (the profiler's waits)."""
        return sum(d.blocked_seconds for d in self.doorways())

    def doorways(self) -> list[Comm]:
        """Every distinct doorway, data planes first."""
        seen: dict[int, Comm] = {}
        for d in (*self._data.values(), *self._control.values(), *self._extra):
            seen.setdefault(id(d), d)
        return list(seen.values())

    def groups(self) -> list[dist.ProcessGroup]:
        """The process groups this topology made (destroyed by :meth:`close`)."""
        return list(self._owned)

    def close(self) -> None:
        """Close every doorway and destroy the groups the topology made (collective)."""
        if self._closed:
            return
        self._closed = True
        for d in self.doorways():
            d.close()
        if dist.is_initialized():
            for g in self._owned:
                dist.destroy_process_group(g)
        self._owned = []  # the last references: their threads are joined now ([Note: teardown])


def _create_groups(
    mesh: Mesh, options: DoorwayOptions, world: int, outside: int
) -> dict[tuple[int, ...], tuple[Any, Any]]:
    """Every group of every axis of ``mesh`` with more than one rank, as (data, control)
    groups, created in the fixed order of [Note: group creation] (collective over the whole
    world, ``outside`` ranks beyond the mesh included). A group of the whole world uses the
    default group for its data plane."""
    if mesh.world_size + outside != world:
        raise ValueError(
            f"the mesh ({mesh.describe()}) has {mesh.world_size} ranks"
            + (f" and {outside} more stand outside it" if outside else "")
            + f", but the process group has {world}"
        )
    timeout = datetime.timedelta(seconds=options.timeout_s)
    created: dict[tuple[int, ...], tuple[Any, Any]] = {}
    for axis in GROUP_AXES:
        if mesh.size(axis) == 1:
            continue
        for ranks in mesh.groups(axis):  # every rank creates every group, in order
            if ranks in created:
                continue
            g_data = None if len(ranks) == world else dist.new_group(list(ranks), timeout=timeout)
            g_ctrl = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
            created[ranks] = (g_data, g_ctrl)
    return created


def _spread_plan(mesh: Mesh, options: DoorwayOptions) -> list[tuple[int, ...]]:
    """The groups (keyed ``(*ranks, -1 - copy)``) that [Note: spread reductions] needs, in the
    order every rank creates them: per spread axis and group of it, per copy, the copy itself
    (not for copy 0, the mesh's own group), then with ``hierarchical`` its intra-node groups and
    its inter-node groups (those of more than one rank). A set of ranks two axes share, or two
    levels share, is one group."""
    keys: list[tuple[int, ...]] = []
    for axis in SPREAD_AXES:
        if mesh.size(axis) == 1:
            continue
        for ranks in mesh.groups(axis):
            for copy in range(options.groups):
                sets = [ranks] if copy else []
                if options.hierarchical:
                    intra, inter = node_layout(ranks, options.ranks_per_node)
                    sets += [tuple(g) for g in (*intra, *inter) if len(g) > 1]
                for s in sets:
                    key = (*s, -1 - copy)
                    if key not in keys:
                        keys.append(key)
    return keys


def _create_spread(
    mesh: Mesh, options: DoorwayOptions, owned: list[Any]
) -> dict[tuple[int, ...], tuple[Any, Any]]:
    """Create the groups of :func:`_spread_plan` (data and gloo control), appending them to
    ``owned``; collective over the whole world."""
    if options.groups < 1:
        raise ValueError(f"comm.groups = {options.groups}: use 1 or more")
    timeout = datetime.timedelta(seconds=options.timeout_s)
    created: dict[tuple[int, ...], tuple[Any, Any]] = {}
    for key in _spread_plan(mesh, options):
        members = list(key[:-1])
        g_data = dist.new_group(members, timeout=timeout)
        g_ctrl = dist.new_group(members, backend="gloo", timeout=timeout)
        owned += [g_data, g_ctrl]
        created[key] = (g_data, g_ctrl)
    return created


def _one(rank: int) -> Comm:
    """A level of one rank (a node with one rank of the group, or one node)."""
    return Collectives.alone(rank, name="one rank")


def _data_doorway(
    group: Any,
    check_group: Any,
    options: DoorwayOptions,
    name: str,
    rules_device: torch.device | None,
) -> Collectives:
    """A data-plane doorway over ``group``, its desync check on the gloo ``check_group``;
    ``rules_device``: the device NCCL's rules hold tensors to (None: no rules)."""
    return Collectives(
        group,
        desync_check=options.desync_check,
        check_group=check_group,
        log=options.log,
        log_verbose=options.log_verbose,
        timeout_s=options.timeout_s,
        name=name,
        rules=Rules(device=rules_device) if rules_device is not None else None,
    )
