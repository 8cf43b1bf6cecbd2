"""The comm log: per-operation counts and byte counts equal what was sent; bandwidths follow
nccl-tests' definitions; the DeepSpeed ``comms_logger`` key maps onto ``comm.log``."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from reference import TinyNet

import longboat
from longboat.comm.collectives import Collectives
from longboat.comm.commlog import CommLog
from longboat.comm.trace import CallRecord
from longboat.config import ConfigError, load_config


def _traffic() -> tuple[list[dict[str, Any]], str]:
    comm = Collectives(log=True, desync_check=True, timeout_s=30)
    n = comm.world_size
    try:
        for _ in range(3):
            comm.all_reduce(torch.ones(10))  # 40 B each
        comm.all_reduce(torch.ones(7, dtype=torch.float64), async_op=True).wait()  # 56 B
        comm.all_gather(
            torch.empty(6 * n, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16)
        )  # output: 12n B
        comm.reduce_scatter(torch.empty(5), torch.ones(5 * n), async_op=True).wait()  # 20n B
        comm.broadcast(torch.ones(3, dtype=torch.int64), src=0)  # 24 B
        comm.barrier()
        return comm.log_summary(), comm.commlog.table()  # type: ignore[union-attr]
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4])
def test_byte_counts_equal_what_was_sent(ranks, n: int) -> None:
    for rows, table in ranks(n, _traffic):
        by_op = {r["op"]: r for r in rows}
        assert {op: (r["count"], r["bytes"]) for op, r in by_op.items()} == {
            "all_reduce": (4, 3 * 40 + 56),
            "all_gather": (1, 12 * n),
            "reduce_scatter": (1, 20 * n),
            "broadcast": (1, 24),
            "barrier": (1, 0),
        }
        for op, factor in (
            ("all_reduce", 2 * (n - 1) / n),
            ("all_gather", (n - 1) / n),
            ("reduce_scatter", (n - 1) / n),
            ("broadcast", 1.0),
        ):
            r = by_op[op]
            assert r["total_s"] > 0 and r["mean_s"] == pytest.approx(r["total_s"] / r["count"])
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["total_s"] / 1e9)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert "all_reduce" in table and f"{3 * 40 + 56:,}" in table


def _engine_traffic(steps: int) -> tuple[list[dict[str, Any]], int, int]:
    torch.manual_seed(0)
    model = TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "batch": {"micro_batch_size": 2},
            "comm": {"log": True},
            "replicate": {"overlap_optimizer": False},
            # The console monitor broadcasts whether rank 0 has a terminal; off, so that only the
            # strategy's traffic is counted.
            "monitor": {"console": False},
        },
    )
    # Gradients: every trainable fp32 parameter once per step, with one 4-byte usage flag per
    # parameter in its bucket ([Note: usage flags]). Setup: rank 0's parameters (frozen ones
    # too) and buffers broadcast once.
    trainable = sum((p.numel() + 1) * 4 for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    try:
        for _ in range(steps):
            engine.backward(engine(torch.randn(2, 12)).sum())
            engine.step()
        return engine.comm.log_summary(), trainable * steps, state
    finally:
        engine.close()


def test_engine_log_counts_gradient_and_setup_bytes(ranks) -> None:
    for rows, grads, state in ranks(2, _engine_traffic, 3):
        by_op = {r["op"]: r["bytes"] for r in rows}
        assert by_op == {"all_reduce": grads, "broadcast": state}, (by_op, grads, state)


def test_deepspeed_comms_logger_maps_to_comm_log() -> None:
    cfg = load_config({"train_batch_size": 8, "comms_logger": {"enabled": True, "verbose": True}})
    assert cfg.comm.log and cfg.comm.log_verbose and cfg.comm.desync_check
    with pytest.raises(ConfigError, match=r"comms_logger\.prof_ops"):
        load_config({"train_batch_size": 8, "comms_logger": {"enabled": True, "prof_ops": []}})


def test_unknown_comm_key_names_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'comm\.timeout_s'"):
        load_config({"comm": {"timeout": 5}})


def test_verbose_log_has_one_line_per_collective(caplog: pytest.LogCaptureFixture) -> None:
    log = CommLog(world_size=2, rank=1, verbose=True)
    rec = CallRecord(
        seq=3,
        op="all_gather",
        dtype="bfloat16",
        shape=(6,),
        out_shape=(12,),
        reduce_op="",
        group="default",
        source="t.py:5 in main",
        caller="",
    )
    with caplog.at_level(logging.INFO, logger="longboat.comm"):
        log.add(rec, 24, 0.002)
        log.add(rec, 24, 0.004)
    assert [r.getMessage() for r in caplog.records] == [
        "rank 1: all_gather(bfloat16[6] -> [12]) #3 at t.py:5 in main 24 B 2.000 ms",
        "rank 1: all_gather(bfloat16[6] -> [12]) #3 at t.py:5 in main 24 B 4.000 ms",
    ]
    (row,) = log.summary()
    assert (row["count"], row["bytes"]) == (2, 48)
    assert row["mean_s"] == pytest.approx(0.003)
    assert row["busbw_gbps"] == pytest.approx(48 / 0.006 / 1e9 * 0.5)


def _scratch_reduce_scatter() -> tuple[list[float], list[float], list[float], bool, int]:
    comm = Collectives(log=True, desync_check=True, timeout_s=30)
    n, r = comm.world_size, comm.rank
    try:
        data = torch.arange(4.0 * n) * (r + 1) + 0.25 * r
        plain, scratch = torch.empty(4), torch.empty(4)
        comm.reduce_scatter(plain, data.clone(), async_op=True).wait()
        given = data.clone()
        h = comm.reduce_scatter(scratch, given, async_op=True, scratch=True)
        deadline = time.monotonic() + 10
        while not h.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)  # over without a wait: ZeRO reaps it during backward
        done = h.is_completed()
        h.wait()
        rows = {row["op"]: row for row in comm.log_summary()}
        return (
            plain.tolist(),
            scratch.tolist(),
            given.tolist(),
            done,
            rows["reduce_scatter"]["count"],
        )
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4])
def test_a_scratch_reduce_scatter_gives_the_same_shard_and_leaves_the_sum_in_its_input(ranks, n):
    """[Note: gloo reduce-scatter]: the same sums as gloo's own (which all-reduces a clone),
    counted as a reduce-scatter, and at 4 ranks its input left holding the whole sum; at 2
    ([Note: gloo reduce-scatter of two]) an all-to-all, the input left as it was."""
    total = sum(torch.arange(4.0 * n) * (r + 1) + 0.25 * r for r in range(n))
    for rank, (plain, scratch, given, done, count) in enumerate(ranks(n, _scratch_reduce_scatter)):
        assert scratch == plain == total.chunk(n)[rank].tolist()
        mine = torch.arange(4.0 * n) * (rank + 1) + 0.25 * rank
        assert given == (mine if n == 2 else total).tolist()
        assert done and count == 2


def _reduce_scatters_without_all_reduce() -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from longboat.comm import collectives

    original, gloos = dist.all_reduce, collectives._reduce_scatter

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an all-reduce or gloo's reduce-scatter was called")

    comm = Collectives(log=True, desync_check=True, timeout_s=30)
    r = comm.rank
    dist.all_reduce = collectives._reduce_scatter = refused
    try:
        data = (torch.arange(8.0) * (r + 1) + 0.1 * r).view(2, 4)
        out, again = torch.empty(4), torch.empty(4)
        comm.reduce_scatter(out, data)
        comm.reduce_scatter(again, data.clone(), async_op=True, scratch=True).wait()
        return out.tolist(), again.tolist()
    finally:
        dist.all_reduce, collectives._reduce_scatter = original, gloos
        comm.close()


def test_at_two_ranks_a_reduce_scatter_sends_half_an_all_reduce(ranks):
    """[Note: gloo reduce-scatter of two]: no all-reduce at all (the case fails if one is
    called), a tensor of two dimensions, and sums equal to the bit."""
    data = [(torch.arange(8.0) * (r + 1) + 0.1 * r) for r in range(2)]
    total = data[0] + data[1]
    for rank, (out, again) in enumerate(ranks(2, _reduce_scatters_without_all_reduce)):
        assert out == again == total.chunk(2)[rank].tolist()


def _gathers(refuse_gloos_own: bool) -> tuple[list[float], list[float], bool, int]:
    from longboat.comm import collectives

    original = collectives._all_gather
    if refuse_gloos_own:  # at two ranks the doorway must not need gloo's own all-gather

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("gloo's all_gather_into_tensor was called")

        collectives._all_gather = refused
    comm = Collectives(log=True, desync_check=True, timeout_s=30)
    n, r = comm.world_size, comm.rank
    try:
        shard = torch.arange(6.0) + 10 * r
        out, again = torch.empty(6 * n), torch.empty(6 * n)
        comm.all_gather(out, shard)
        h = comm.all_gather(again, shard * 2, async_op=True)
        h.wait()
        # tensors of several dimensions, gathered along the first (tensor parallelism's)
        rows2 = torch.empty(2 * n, 3)
        comm.all_gather(rows2, shard.view(2, 3))
        rows = {row["op"]: row for row in comm.log_summary()}
        assert torch.equal(rows2.view(-1), out), (rows2, out)
        return out.tolist(), again.tolist(), h.is_completed(), rows["all_gather"]["count"]
    finally:
        collectives._all_gather = original
        comm.close()


@pytest.mark.parametrize("n", [2, 3])
def test_an_all_gather_gives_every_rank_every_shard_in_rank_order(ranks, n):
    """[Note: gloo all-gather of two]: at two ranks an all-to-all without staging, gloo's own
    all-gather not called at all (the case fails if it is); at three, gloo's own."""
    want = torch.cat([torch.arange(6.0) + 10 * r for r in range(n)]).tolist()
    for out, again, done, count in ranks(n, _gathers, n == 2):
        assert out == want and again == [2 * v for v in want]
        assert done and count == 3
