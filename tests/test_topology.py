"""The topology on real gloo ranks: one doorway per axis whose group is the mesh's, group-relative
ranks, point-to-point between pipeline neighbours, the control plane, and the NCCL-rules mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longboat.comm.collectives import Collectives, Rules, RulesError
from longboat.comm.protocol import Comm
from longboat.mesh import GROUP_AXES, Mesh
from longboat.topology import DoorwayOptions, Topology


def _build(mesh: Mesh, check: bool = True) -> Topology:
    return Topology.build(
        mesh, DoorwayOptions(desync_check=check, timeout_s=30), torch.device("cpu")
    )


def _axes(mesh_kwargs: dict) -> dict:
    rank = torch.distributed.get_rank()
    mesh = Mesh(**mesh_kwargs)
    topo = _build(mesh)
    out = {}
    for axis in GROUP_AXES:
        d = topo.data(axis)
        c = topo.control(axis)
        # each doorway's group is the mesh's group along that axis, in group order
        t = torch.tensor([float(rank)])
        d.all_reduce(t)
        members = torch.zeros(d.world_size)
        d.all_gather(members, torch.tensor([float(rank)]))
        ct = torch.tensor([1.0])
        c.all_reduce(ct)
        out[axis] = {
            "size": d.world_size,
            "rank": d.rank,
            "sum": t.item(),
            "members": [int(x) for x in members.tolist()],
            "control": ct.item(),
            "globals": [d.global_rank(i) for i in range(d.world_size)],
        }
    topo.close()
    return out


@pytest.mark.parametrize(
    "mesh_kwargs", [{"dp_replicate": 2, "dp_shard": 2}, {"dp_shard": 4}, {"pp": 2, "dp_shard": 2}]
)
def test_every_axis_talks_within_its_group(ranks, mesh_kwargs):
    mesh = Mesh(**mesh_kwargs)
    for rank, axes in enumerate(ranks(4, _axes, mesh_kwargs)):
        for axis, got in axes.items():
            group = mesh.group_of(axis, rank)
            assert got["size"] == len(group)
            assert got["rank"] == group.index(rank)
            assert got["members"] == list(group) == got["globals"], axis
            assert got["sum"] == sum(group), axis
            assert got["control"] == len(group), axis


def _broadcast_and_p2p() -> dict:
    rank = torch.distributed.get_rank()
    topo = _build(Mesh(dp_replicate=2, dp_shard=2))
    shard = topo.data("dp_shard")  # groups (0, 1) and (2, 3)
    t = torch.tensor([float(rank)])
    shard.broadcast(t, src=1)  # group rank 1: global rank 1 in the first group, 3 in the second
    # point to point along dp_replicate (groups (0, 2) and (1, 3)): rank 0 of each sends
    reps = topo.data("dp_replicate")
    box = torch.tensor([float(rank * 10)])
    if reps.rank == 0:
        reps.send(box, dst=1)
    else:
        reps.recv(box, src=0)
    topo.close()
    return {"broadcast": t.item(), "p2p": box.item()}


def test_broadcast_and_point_to_point_name_group_ranks(ranks):
    got = ranks(4, _broadcast_and_p2p)
    assert [g["broadcast"] for g in got] == [1.0, 1.0, 3.0, 3.0]
    assert [g["p2p"] for g in got] == [0.0, 10.0, 0.0, 10.0]  # 2 got 0's, 3 got 1's


def test_doorways_implement_the_protocol():
    topo = _build(Mesh())  # a world of one: every doorway alone
    for axis in GROUP_AXES:
        assert isinstance(topo.data(axis), Comm) and isinstance(topo.control(axis), Comm)
        assert topo.data(axis).world_size == 1
    topo.close()


def test_rules_refuse_what_nccl_or_the_control_plane_would():
    data, control = Rules(device=torch.device("cpu")), Rules(max_bytes=64)
    data.check("all_reduce", (torch.zeros(3),), "dp")
    with pytest.raises(RulesError, match="not on the model's device cpu"):
        data.check("all_reduce", (torch.zeros(3, device="meta"),), "dp")
    control.check("all_reduce", (torch.zeros(16),), "world, control")
    with pytest.raises(RulesError, match=r"control plane.*small CPU tensors"):
        control.check("all_reduce", (torch.zeros(17),), "world, control")
    with pytest.raises(RulesError, match="control plane"):
        control.check("all_reduce", (torch.zeros(1, device="meta"),), "world, control")


def _rules_on() -> dict:
    from reference import TinyNet

    import longboat

    model = TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {"batch": {"micro_batch_size": 2}, "log": {"progress": False, "level": "WARNING"}},
    )
    out = {"data": engine.comm.rules, "control": engine.control.rules}
    try:
        engine.control.all_reduce(torch.zeros(2**23))  # 32 MiB: not for the control plane
    except RulesError as e:
        out["refused"] = str(e)
    engine.close()
    return out


def test_the_suite_runs_under_nccl_rules(ranks):
    """conftest turns the rules on for every topology the tests build ([Note: NCCL rules])."""
    for got in ranks(2, _rules_on):
        assert got["data"] == Rules(device=torch.device("cpu"))
        assert got["control"] == Rules()
        assert "control plane" in got["refused"]


def test_alone_is_the_identity():
    solo = Collectives.alone(global_rank=3)
    t = torch.ones(2)
    solo.all_reduce(t, op="avg")
    assert torch.equal(t, torch.ones(2)) and solo.global_rank(0) == 3
    with pytest.raises(RuntimeError, match="no peer"):
        solo.send(t, dst=0)


def _gloo_threads() -> int:
    """This process's gloo worker threads (one pair per live gloo group)."""
    task = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in task.iterdir())


def _threads_around_close() -> dict:
    import longboat
    from tests import reference

    before = _gloo_threads()
    topo = _build(Mesh(dp_replicate=2, dp_shard=2))  # its own groups, and a desync check
    built = _gloo_threads()
    doorway = topo.data("dp_shard")
    topo.close()
    closed = _gloo_threads()
    try:
        doorway.all_reduce(torch.ones(1))
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    # an engine with gathers right before close (ZeRO-3: close gathers every unit back)
    torch.manual_seed(0)
    model = reference.TinyNet()
    cfg = {
        "strategy": "zero",
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "mesh": {"dp_replicate": 2, "dp_shard": 2},
        "batch": {"micro_batch_size": 2},
        "log": {"progress": False, "level": "WARNING"},
    }
    engine = longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    engine.backward(engine(torch.randn(2, 12)).square().mean())
    engine.step()
    with_engine = _gloo_threads()
    engine.close()
    return {
        "before": before,
        "built": built,
        "closed": closed,
        "refused": refused,
        "with_engine": with_engine,
        "engine_closed": _gloo_threads(),
    }


def test_close_joins_the_threads_of_the_groups_it_made(ranks):
    # [Note: teardown] in comm/collectives.py: a group still referenced after
    # destroy_process_group keeps its gloo threads, which can abort the process at exit.
    for got in ranks(4, _threads_around_close):
        assert got["built"] > got["before"], got
        assert got["closed"] == got["before"], got
        assert "closed (engine.close() was called)" in got["refused"]
        assert got["with_engine"] > got["before"], got
        assert got["engine_closed"] == got["before"], got
