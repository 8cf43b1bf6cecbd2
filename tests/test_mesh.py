"""The mesh's arithmetic, without processes: sizes checked against the world, coordinates and
ranks as inverse functions, groups that partition the world, pipeline neighbours."""

from __future__ import annotations

import pytest

from longboat.mesh import AXES, GROUP_AXES, Mesh, MeshError


def test_plain_data_parallelism_is_the_default():
    mesh = Mesh.resolve(4)
    assert (mesh.pp, mesh.dp_replicate, mesh.dp_shard, mesh.tp) == (1, 1, 4, 1)
    assert mesh.dp == mesh.world_size == 4
    assert mesh.groups("dp") == mesh.groups("world") == [(0, 1, 2, 3)]
    assert mesh.groups("dp_replicate") == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize(
    ("world", "kwargs", "want"),
    [
        (8, {"pp": 2}, (2, 1, 4, 1)),
        (8, {"tp": 2}, (1, 1, 4, 2)),
        (8, {"pp": 2, "tp": 2}, (2, 1, 2, 2)),
        (4, {"dp_replicate": 2}, (1, 2, 2, 1)),
        (4, {"dp_shard": 2}, (1, 2, 2, 1)),
        (8, {"tp": 2, "dp_replicate": 2, "dp_shard": 2}, (1, 2, 2, 2)),
        (6, {"dp": 3, "tp": 2}, (1, 1, 3, 2)),
    ],
)
def test_sizes_are_derived(world, kwargs, want):
    m = Mesh.resolve(world, **kwargs)
    assert (m.pp, m.dp_replicate, m.dp_shard, m.tp) == want
    assert m.world_size == world


@pytest.mark.parametrize(
    ("world", "kwargs", "words"),
    [
        (4, {"pp": 3}, ["pp=3", "tp=1", "= 3", "world size 4"]),
        (8, {"pp": 2, "dp": 3}, ["pp=2", "dp=3", "tp=1", "= 6", "world size 8"]),
        (4, {"dp_replicate": 3}, ["dp_replicate=3", "dp=4"]),
        (4, {"dp_replicate": 2, "dp_shard": 3}, ["dp_replicate=2", "dp_shard=3"]),
        (4, {"tp": 0}, ["mesh.tp = 0"]),
    ],
)
def test_sizes_that_do_not_fit_are_refused_by_name(world, kwargs, words):
    with pytest.raises(MeshError) as info:
        Mesh.resolve(world, **kwargs)
    for w in words:
        assert w in str(info.value), str(info.value)


MESHES = [
    Mesh(pp=2, dp_replicate=2, dp_shard=3, tp=2),
    Mesh(dp_shard=4),
    Mesh(pp=3, tp=2),
    Mesh(dp_replicate=2, dp_shard=2),
]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coordinates_and_ranks_are_inverse(mesh):
    seen = set()
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert mesh.rank_of(**{a: c[a] for a in AXES}) == rank
        assert c["dp"] == c["dp_replicate"] * mesh.dp_shard + c["dp_shard"]
        seen.add(tuple(c[a] for a in AXES))
    assert len(seen) == mesh.world_size
    # tp innermost: a tp group's ranks are consecutive
    for g in mesh.groups("tp"):
        assert list(g) == list(range(g[0], g[0] + mesh.tp))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("axis", GROUP_AXES)
def test_groups_partition_the_world_and_vary_one_axis(mesh, axis):
    groups = mesh.groups(axis)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.world_size))
    assert all(len(g) == mesh.size(axis) for g in groups)
    varying = {"dp": ("dp_replicate", "dp_shard"), "world": AXES}.get(axis, (axis,))
    for g in groups:
        fixed = [{a: mesh.coords(r)[a] for a in AXES if a not in varying} for r in g]
        assert all(f == fixed[0] for f in fixed)
        assert mesh.group_of(axis, g[-1]) == g
    # dp is flattened replicate-major: its group order is its coordinate order
    if axis == "dp":
        for g in groups:
            assert [mesh.coords(r)["dp"] for r in g] == list(range(mesh.dp))


def test_pipeline_neighbours():
    mesh = Mesh(pp=3, dp_shard=2)
    for rank in range(6):
        prev, nxt = mesh.pipeline_neighbours(rank)
        c = mesh.coords(rank)
        assert prev == (None if c["pp"] == 0 else rank - 2)
        assert nxt == (None if c["pp"] == 2 else rank + 2)


def test_out_of_range():
    mesh = Mesh(dp_shard=2)
    with pytest.raises(MeshError, match="rank 2 is outside"):
        mesh.coords(2)
    with pytest.raises(MeshError, match="dp_shard=5"):
        mesh.rank_of(dp_shard=5)
    with pytest.raises(MeshError, match="unknown mesh axis"):
        mesh.groups("cp")  # type: ignore[arg-type]
