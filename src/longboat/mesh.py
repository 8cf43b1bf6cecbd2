"""The mesh: the job's ranks laid out on named axes, and the arithmetic between a rank and its
coordinates. Pure functions of sizes; nothing here touches ``torch.distributed``
(:mod:`longboat.topology` builds the process groups from it).

[Note: mesh] Axes, outermost to innermost: ``pp`` (pipeline stages), ``dp_replicate`` and
``dp_shard`` (data parallelism: replicas of a sharded model, and the ranks one replica is sharded
over), ``tp`` (tensor parallelism). ``dp`` is ``dp_replicate`` x ``dp_shard`` flattened: the ranks
that see different data. A rank's number is its coordinates read as digits, the innermost
fastest::

    rank = ((pp * dp_replicate + r) * dp_shard + s) * tp + t

so the ranks of one ``tp`` group are consecutive (on one node, where the bandwidth is), as in
torchtitan's ``ParallelDims``. With every axis but ``dp`` of size 1, ``dp`` is the whole world
and ``dp_shard == dp``: the layout of plain data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The mesh's own axes, outermost first.
AXES = ("pp", "dp_replicate", "dp_shard", "tp")
#: Every axis a group can be asked for: the mesh's own, ``dp`` (dp_replicate x dp_shard), and
#: ``world`` (every rank).
Axis = Literal["pp", "dp_replicate", "dp_shard", "dp", "tp", "world"]
GROUP_AXES: tuple[Axis, ...] = ("pp", "dp_replicate", "dp_shard", "dp", "tp", "world")


class MeshError(ValueError):
    """Sizes that do not fit the world; the message names each size and the product."""


@dataclass(frozen=True)
class Mesh:
    """Axis sizes; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh.{axis} = {size!r}: every axis needs a size of 1 or more")

    # -- sizes ---------------------------------------------------------------------------------

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        pp: int = 1,
        tp: int = 1,
        dp: int | None = None,
        dp_replicate: int | None = None,
        dp_shard: int | None = None,
    ) -> Mesh:
        """The mesh for ``world_size`` ranks: ``dp`` defaults to what ``pp`` and ``tp`` leave,
        ``dp_shard`` to ``dp / dp_replicate`` (so without ``dp_replicate`` the data-parallel
        ranks shard one replica). Raises :class:`MeshError` naming the sizes that disagree."""
        for name, v in (
            ("pp", pp),
            ("tp", tp),
            ("dp", dp),
            ("dp_replicate", dp_replicate),
            ("dp_shard", dp_shard),
        ):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise MeshError(f"mesh.{name} = {v!r}: every axis needs a size of 1 or more")
        if world_size % (pp * tp):
            raise MeshError(
                f"mesh: pp={pp} x tp={tp} = {pp * tp} does not divide the world size "
                f"{world_size}; choose sizes whose product divides it"
            )
        derived = world_size // (pp * tp)
        if (
            dp is None
            and dp_replicate is not None
            and dp_shard is not None
            and dp_replicate * dp_shard != derived
        ):
            raise MeshError(
                f"mesh: dp_replicate={dp_replicate} x dp_shard={dp_shard} = "
                f"{dp_replicate * dp_shard}, but pp={pp} x tp={tp} leaves dp={derived} of "
                f"the world size {world_size}"
            )
        dp = derived if dp is None else dp
        if pp * dp * tp != world_size:
            raise MeshError(
                f"mesh: pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} does not equal the world "
                f"size {world_size}; leave mesh.dp out to derive it ({derived})"
            )
        if dp_replicate is None and dp_shard is None:
            dp_replicate, dp_shard = 1, dp
        elif dp_replicate is None:
            assert dp_shard is not None
            if dp % dp_shard:
                raise MeshError(f"mesh: dp_shard={dp_shard} does not divide dp={dp}")
            dp_replicate = dp // dp_shard
        elif dp_shard is None:
            if dp % dp_replicate:
                raise MeshError(f"mesh: dp_replicate={dp_replicate} does not divide dp={dp}")
            dp_shard = dp // dp_replicate
        if dp_replicate * dp_shard != dp:
            raise MeshError(
                f"mesh: dp_replicate={dp_replicate} x dp_shard={dp_shard} = "
                f"{dp_replicate * dp_shard} does not equal dp={dp}"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def size(self, axis: Axis) -> int:
        """How many ranks one group along ``axis`` has."""
        if axis == "dp":
            return self.dp
        if axis == "world":
            return self.world_size
        return int(getattr(self, axis))

    def describe(self) -> str:
        """``pp 1 x dp 4 (replicate 2 x shard 2) x tp 1``."""
        dp = f"dp {self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
        return f"pp {self.pp} x {dp} x tp {self.tp}"

    # -- coordinates ---------------------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` on every mesh axis, and on ``dp`` (flattened)."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            size = int(getattr(self, axis))
            out[axis] = rank % size
            rank //= size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return {axis: out[axis] for axis in (*AXES, "dp")}

    def rank_of(self, pp: int = 0, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 0) -> int:
        """The rank at these coordinates."""
        rank = 0
        for axis, c in zip(AXES, (pp, dp_replicate, dp_shard, tp), strict=True):
            size = int(getattr(self, axis))
            if not 0 <= c < size:
                raise MeshError(f"mesh coordinate {axis}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def groups(self, axis: Axis) -> list[tuple[int, ...]]:
        """Every group of ranks along ``axis`` (ranks that differ only in that axis's
        coordinates), each in increasing rank order, the groups ordered by their first rank.
        The groups of an axis partition the world."""
        if axis == "world":
            return [tuple(range(self.world_size))]
        varying = ("dp_replicate", "dp_shard") if axis == "dp" else (axis,)
        if axis not in (*AXES, "dp"):
            raise MeshError(f"unknown mesh axis {axis!r}; choose one of {GROUP_AXES}")
        out: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[a] for a in AXES if a not in varying)
            out.setdefault(key, []).append(rank)
        return sorted((tuple(g) for g in out.values()), key=lambda g: g[0])

    def group_of(self, axis: Axis, rank: int) -> tuple[int, ...]:
        """The group along ``axis`` that ``rank`` belongs to."""
        self._check_rank(rank)
        return next(g for g in self.groups(axis) if rank in g)

    def pipeline_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """The ranks holding the previous and the next pipeline stage of ``rank``'s slice of the
        model (same dp and tp coordinates); None at either end."""
        c = self.coords(rank)
        at = {a: c[a] for a in AXES}

        def stage(pp: int) -> int | None:
            return self.rank_of(**{**at, "pp": pp}) if 0 <= pp < self.pp else None

        return stage(c["pp"] - 1), stage(c["pp"] + 1)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise MeshError(
                f"rank {rank} is outside the mesh's {self.world_size} ranks ({self.describe()})"
            )
