"""Reductions spread over several process groups (``comm.groups``) and the hierarchical
all-reduce (``comm.hierarchical``, [Note: hierarchical all-reduce] in
longboat/comm/hierarchical.py): each trains what the plain PyTorch loop of ``reference.py``
trains (every micro-batch's loss, then parameters, buffers, optimizer state), on the model with
conditionally used, never-used, frozen and tied parameters, at 2 and 4 ranks; the comm logs of
the copies and of the node levels show where the bytes went."""

from __future__ import annotations

import harness
import pytest
import reference
import torch

import longboat
from longboat.comm.hierarchical import Hierarchical, node_layout
from longboat.config import ConfigError, load_config
from longboat.mesh import Mesh
from longboat.testing import RankFailure
from longboat.topology import DoorwayOptions, _spread_plan

STEPS = 4
GLOBAL_BATCH = 16
TOL = 1e-5  # fp32, relative, as the equivalence tests
RECIPE = reference.Recipe(model="zoo", optimizer="adamw", clip=1.0, scheduler=True)
ZOO = {**harness.ZOO_STRATEGIES}
# ZeRO-2 within pairs of ranks, replicated across the pairs ([Note: hybrid sharding]).
ZOO["zero2-hybrid"] = {**ZOO["zero2"], "mesh": {"dp_replicate": 2}}

CASES = [
    # (strategy, world, comm)
    ("replicate", 2, {"groups": 2}),
    ("replicate", 2, {"groups": 3}),
    ("replicate", 4, {"groups": 2}),
    ("replicate", 4, {"groups": 3}),
    ("zero1", 4, {"groups": 2}),
    ("zero2", 2, {"groups": 3}),
    ("zero3", 4, {"groups": 2}),
    ("zero2-hybrid", 4, {"groups": 2}),  # copies of the dp_shard pairs, apart from dp's
    ("replicate", 4, {"hierarchical": True, "ranks_per_node": 2}),  # 2 nodes x 2
    ("replicate", 4, {"hierarchical": True, "ranks_per_node": 1}),  # 4 nodes x 1
    ("replicate", 4, {"hierarchical": True, "ranks_per_node": 4}),  # 1 node x 4
    ("replicate", 4, {"hierarchical": True, "ranks_per_node": 2, "groups": 2}),
    ("replicate", 2, {"hierarchical": True, "ranks_per_node": 1}),
]


@pytest.mark.parametrize(("strategy", "world", "comm"), CASES, ids=str)
def test_equals_plain_pytorch(ranks, strategy, world, comm):
    results, _ = harness.run_and_compare(
        ranks,
        world,
        ZOO[strategy],
        RECIPE,
        STEPS,
        accum=2,
        global_batch=GLOBAL_BATCH,
        tol=TOL,
        comm=comm,
    )
    for r, res in enumerate(results):  # the replicas stay bit-identical
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"rank {r} differs at {k}"


# -- where the bytes went ---------------------------------------------------------------------


def _traffic(cfg: dict) -> dict:
    """Train two steps with the comm log on; every doorway's log rows by its name, and the
    bucket buffers' sizes in bytes."""
    model, opt, sched = RECIPE.build()
    engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    data = harness.data_for(RECIPE, engine.batch.train_batch_size * 2)
    for _, *rest in engine.loader(data):
        engine.backward(reference.forward_loss(engine, rest))
        if engine.step() and engine.global_step == 2:
            break
    logs = {
        d._group_name: {row["op"]: row for row in d.log_summary()}  # type: ignore[attr-defined]
        for d in engine.topology.doorways()
        if d.log
    }
    plan = getattr(engine.strategy, "plan", None)  # replicate's buckets, or ZeRO's units
    buckets = (
        [b.buffer.numel() * b.buffer.element_size() for b in plan.buckets]
        if plan is not None
        else [u.padded * torch.finfo(u.dtype).bits // 8 for u in engine.strategy.units]
    )
    engine.close()
    return {"logs": logs, "buckets": buckets, "steps": engine.global_step}


def _logged(world: int, comm: dict, strategy: str = "replicate") -> dict:
    return harness.config(
        ZOO[strategy],
        RECIPE,
        GLOBAL_BATCH,
        GLOBAL_BATCH // (2 * world),
        comm={"log": True, **comm},
    )


def _op(logs: dict, name: str, op: str) -> tuple[int, int]:
    row = logs.get(name, {}).get(op)
    return (row["count"], row["bytes"]) if row else (0, 0)


def test_buckets_spread_round_robin_over_the_copies(ranks):
    groups = 3
    for rank, res in enumerate(ranks(2, _traffic, _logged(2, {"groups": groups}))):
        logs, sizes, steps = res["logs"], res["buckets"], res["steps"]
        assert len(sizes) > groups, "enough buckets to reach every copy"
        for copy in range(1, groups):
            mine = sizes[copy::groups]  # bucket k goes through copy k mod groups
            got = _op(logs, f"dp [0, 1] copy {copy}", "all_reduce")
            assert got == (steps * len(mine), steps * sum(mine)), f"rank {rank}, copy {copy}"
        # Copy 0 is the mesh's own group: its buckets, and whatever else sums over dp.
        count, nbytes = _op(logs, "world", "all_reduce")
        assert count >= steps * len(sizes[::groups])
        assert nbytes >= steps * sum(sizes[::groups])


def test_zero_units_spread_round_robin_over_the_copies(ranks):
    for rank, res in enumerate(ranks(2, _traffic, _logged(2, {"groups": 2}, "zero2"))):
        logs, units = res["logs"], res["buckets"]
        assert len(units) > 2, "enough units to reach both copies"
        mine = _op(logs, "dp [0, 1] copy 1", "reduce_scatter")
        own = _op(logs, "world", "reduce_scatter")
        times = (mine[0] + own[0]) // len(units)  # reductions of each unit in the run
        assert times > 0 and mine[0] + own[0] == times * len(units), f"rank {rank}"
        assert mine == (times * len(units[1::2]), times * sum(units[1::2])), f"rank {rank}"
        assert own == (times * len(units[::2]), times * sum(units[::2])), f"rank {rank}"


def test_hierarchical_sends_a_node_share_across_nodes(ranks):
    res = ranks(4, _traffic, _logged(4, {"hierarchical": True, "ranks_per_node": 2}))
    for rank, r in enumerate(res):
        logs, sizes, steps = r["logs"], r["buckets"], r["steps"]
        node, position = divmod(rank, 2)
        within = f"within node {[2 * node, 2 * node + 1]} copy 0"
        across = f"across nodes {[position, position + 2]} copy 0"
        padded = [2 * -(-s // 8) * 4 for s in sizes]  # fp32 buffers padded to 2 chunks
        rs_count, rs_bytes = _op(logs, within, "reduce_scatter")
        ag_count, ag_bytes = _op(logs, within, "all_gather")
        ar_count, ar_bytes = _op(logs, across, "all_reduce")
        assert rs_count == ag_count == ar_count == steps * len(sizes), f"rank {rank}"
        # Within the node the whole bucket; across nodes only this rank's half of it.
        assert rs_bytes == ag_bytes == steps * sum(padded), f"rank {rank}"
        assert ar_bytes == steps * sum(p // 2 for p in padded), f"rank {rank}"
        # No bucket went through the flat group of all four.
        assert _op(logs, "world", "all_reduce")[1] < min(sizes), f"rank {rank}"


# -- layouts and refusals ----------------------------------------------------------------------


def test_node_layout():
    assert node_layout([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert node_layout([0, 1, 2, 3], 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    assert node_layout([0, 1, 2, 3], 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert node_layout([1, 3, 5, 7], 4) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]])  # a tp stride
    with pytest.raises(ConfigError, match=r"node 0 holds 3, node 1 holds 1"):
        node_layout([0, 1, 2, 3], 3)


class _Recorder:
    """A doorway that only records the order of what it is asked (and moves chunks as rank 0
    of ``world_size`` would, every other rank sending zeros)."""

    def __init__(self, name: str, world_size: int, calls: list[str]) -> None:
        self.name, self.world_size, self.calls = name, world_size, calls
        self.rank, self.active, self.timeout_s = 0, True, 1.0
        self.desync_check = self.log = False

    def _done(self, op: str) -> _Recorded:
        self.calls.append(f"{self.name} {op}")
        return _Recorded(self.calls, f"{self.name} {op}")

    def reduce_scatter(self, output, input, async_op=False, tag="", scratch=False):
        output.copy_(input.view(self.world_size, -1)[0])
        return self._done("reduce_scatter")

    def all_reduce(self, tensor, op="sum", async_op=False, tag=""):
        return self._done("all_reduce")

    def all_gather(self, output, input, async_op=False, tag=""):
        output.view(self.world_size, -1).copy_(input)
        return self._done("all_gather")


class _Recorded:
    def __init__(self, calls: list[str], what: str) -> None:
        self.calls, self.what = calls, what

    def wait(self) -> bool:
        self.calls.append(f"wait {self.what}")
        return True

    def is_completed(self) -> bool:
        return True


def test_hierarchical_launches_the_step_across_nodes_with_the_next_bucket():
    calls: list[str] = []
    intra, inter = _Recorder("intra", 2, calls), _Recorder("inter", 2, calls)
    levels = Hierarchical(_Recorder("flat", 4, calls), intra, inter)
    first = levels.all_reduce(torch.ones(5), op="avg", async_op=True)
    assert calls == ["intra reduce_scatter"]
    second = levels.all_reduce(torch.ones(6), op="avg", async_op=True)
    # The second bucket's launch waits for the first's node sum and sends it across nodes.
    assert calls[1:] == ["intra reduce_scatter", "wait intra reduce_scatter", "inter all_reduce"]
    del calls[:]
    first.wait()
    assert calls == ["wait inter all_reduce", "intra all_gather"]
    del calls[:]
    second.wait()
    assert calls == [
        "wait intra reduce_scatter",
        "inter all_reduce",
        "wait inter all_reduce",
        "intra all_gather",
    ]


def test_spread_plan_is_the_same_list_of_groups_on_every_rank():
    plan = _spread_plan(
        Mesh(dp_shard=4), DoorwayOptions(groups=2, hierarchical=True, ranks_per_node=2)
    )
    # dp and dp_shard are the same ranks: one set of groups; copy 1 adds the flat copy.
    assert plan == [
        (0, 1, -1),
        (2, 3, -1),
        (0, 2, -1),
        (1, 3, -1),
        (0, 1, 2, 3, -2),
        (0, 1, -2),
        (2, 3, -2),
        (0, 2, -2),
        (1, 3, -2),
    ]
    assert _spread_plan(Mesh(dp_shard=4), DoorwayOptions()) == []


def test_config_names_the_key():
    with pytest.raises(ConfigError, match=r"comm\.groups"):
        load_config({"comm": {"groups": 0}})
    with pytest.raises(ConfigError, match=r"comm\.hierarchical = true with strategy 'zero'"):
        load_config({"strategy": "zero", "comm": {"hierarchical": True}})
    with pytest.raises(ConfigError, match=r"comm\.ranks_per_node"):
        load_config({"comm": {"ranks_per_node": 0}})


def _zero_hierarchical() -> None:
    cfg = harness.config(
        ZOO["zero2"], RECIPE, GLOBAL_BATCH, 4, comm={"hierarchical": True, "ranks_per_node": 1}
    )
    harness.train(RECIPE, cfg, 1)


def test_zero_refuses_hierarchical_by_name(ranks):
    with pytest.raises(RankFailure, match=r"comm\.hierarchical = true"):
        ranks(2, _zero_hierarchical)


def _uneven_nodes() -> None:
    cfg = harness.config(
        ZOO["replicate"], RECIPE, GLOBAL_BATCH, 4, comm={"hierarchical": True, "ranks_per_node": 3}
    )
    harness.train(RECIPE, cfg, 1)


def test_uneven_nodes_are_refused_naming_the_sizes(ranks):
    with pytest.raises(RankFailure, match=r"node 0 holds 3, node 1 holds 1"):
        ranks(4, _uneven_nodes)
