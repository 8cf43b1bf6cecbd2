"""``longboat.horovod.torch`` against Horovod's documented contract, at 2 and 3 ranks: ranks that
disagree get an error on every rank ([Note: Horovod negotiation]), every dtype travels
([Note: Horovod wire dtypes]), and the calls Horovod documents (grouped allreduce, ragged
allgather, alltoall with splits, reducescatter, object exchange, sparse allreduce, build
queries) give what their documentation says. Expected values are computed here with plain torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import harness
import pytest
import torch

SCRIPTS = Path(__file__).parent / "launch_scripts"


def _disagree(case: str) -> dict:
    """Each rank issues its side of ``case``; returns the error each rank got, then the result of
    an allreduce after it (the ranks must still be in step)."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    try:
        if case == "shape":
            hvd.allreduce(torch.ones(2 + r))
        elif case == "dtype":  # the same byte size: gloo alone "succeeds" with garbage
            hvd.allreduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32))
        elif case == "root":
            hvd.broadcast(torch.ones(3), root_rank=r % 2)
        elif case == "name":
            hvd.allreduce(torch.ones(3), name=f"loss.{r}")
        elif case == "op":
            if r == 0:
                hvd.allreduce(torch.ones(3))
            else:
                hvd.allgather(torch.ones(3))
        elif case == "reduce":
            hvd.allreduce(torch.ones(3), op=hvd.Sum if r == 0 else hvd.Average)
        elif case == "row shape":  # allgather: first dims may differ, the rest may not
            hvd.allgather(torch.ones(2, 1 + (r > 0)))
        error = ""
    except hvd.HorovodInternalError as e:
        error = str(e)
    after = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum).item()
    return {"error": error, "after": after}


CASES = {
    "shape": "tensor shapes",
    "dtype": "data types",
    "root": "root ranks",
    "name": "tensor names",
    "op": "operations",
    "reduce": "reduction ops",
    "row shape": "tensor shapes",
}


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_disagree_get_the_same_error_on_every_rank(ranks, n):
    for case, what in CASES.items():
        got = ranks(n, _disagree, case)
        for r, out in enumerate(got):
            assert "Mismatched" in out["error"] and what in out["error"], (case, r, out)
            assert "rank 0:" in out["error"] and "rank 1:" in out["error"], (case, out)
            assert out["after"] == n * (n + 1) / 2, (case, r, out)
        assert len({out["error"] for out in got}) == 1, (case, got)


# Every dtype torch has that Horovod moves; gloo itself refuses the last four.
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64]
DTYPES += [torch.int16, torch.uint16, torch.uint32, torch.uint64]
SUMMED = [torch.float32, torch.bfloat16, torch.int8, torch.int16, torch.uint16, torch.uint32]
SUMMED += [torch.uint64, torch.float8_e4m3fn]


def _values(r: int, dtype: torch.dtype, rows: int = 3) -> torch.Tensor:
    """Rank ``r``'s tensor of ``rows`` x 2 in ``dtype``: small values that differ by rank."""
    t = torch.arange(rows * 2).reshape(rows, 2) + 10 * r
    return (t % 2 == 0).to(dtype) if dtype == torch.bool else t.to(dtype)


def _bytes(t: torch.Tensor) -> tuple:
    """``t`` as its dtype, shape and bytes (tensors of some dtypes do not pickle)."""
    return str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).tolist()


def _every_dtype() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {}
    for dtype in DTYPES:
        key = str(dtype)
        out[key] = {
            "gather": _bytes(hvd.allgather(_values(r, dtype, rows=r + 1))),
            "broadcast": _bytes(hvd.broadcast(_values(r, dtype), root_rank=n - 1)),
            "alltoall": _bytes(hvd.alltoall(_values(r, dtype, rows=n))),
        }
    for dtype in SUMMED:
        out[f"sum {dtype}"] = _bytes(hvd.allreduce(_values(r, dtype), op=hvd.Sum))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_every_dtype_is_gathered_broadcast_exchanged_and_summed(ranks, n):
    for r, out in enumerate(ranks(n, _every_dtype)):
        for dtype in DTYPES:
            got = out[str(dtype)]
            want = torch.cat([_values(q, dtype, rows=q + 1) for q in range(n)])
            assert got["gather"] == _bytes(want), dtype
            assert got["broadcast"] == _bytes(_values(n - 1, dtype)), dtype
            want = torch.stack([_values(q, dtype, rows=n)[r] for q in range(n)])
            assert got["alltoall"] == _bytes(want), dtype
        for dtype in SUMMED:
            wide = sum(_values(q, dtype).double() for q in range(n))
            want = wide.to(dtype) if dtype != torch.uint64 else wide.to(torch.int64).to(dtype)
            assert out[f"sum {dtype}"] == _bytes(want), (dtype, out[f"sum {dtype}"], want)


def _documented_calls() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    a, b = torch.tensor([1.0, 2.0]) * (r + 1), torch.tensor([r + 1], dtype=torch.int64)
    grouped = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    handle = hvd.grouped_allreduce_async([a, b], op=hvd.Average)
    polled = hvd.poll(handle)
    averaged = hvd.synchronize(handle)
    in_place = [a.clone(), b.clone()]
    returned = hvd.grouped_allreduce_(in_place, op=hvd.Sum, prescale_factor=2.0)
    # rank r sends r + 1 rows to every other rank's neighbour: splits differ per rank
    splits = torch.tensor([(r + q) % 3 for q in range(n)])
    rows = int(splits.sum())
    sent = torch.arange(rows, dtype=torch.float32).unsqueeze(1) + 100 * r
    sparse = torch.sparse_coo_tensor([[r, n]], [1.0, float(r + 1)], (n + 1,))
    return {
        "grouped": grouped,
        "inputs unchanged": torch.equal(a, torch.tensor([1.0, 2.0]) * (r + 1)),
        "polled": isinstance(polled, bool) and hvd.poll(handle),
        "averaged": averaged,
        "in place": returned is in_place and in_place == returned,
        "in_place": in_place,
        "alltoall": hvd.alltoall(sent, splits),
        "reducescatter": hvd.reducescatter(torch.arange(14.0).reshape(7, 2) * (r + 1), op=hvd.Sum),
        "broadcast_object": hvd.broadcast_object({"from": r, "list": [r]}, root_rank=n - 1),
        "allgather_object": hvd.allgather_object(("rank", r)),
        "sparse": hvd.sparse_allreduce(sparse, op=hvd.Sum).to_dense(),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_the_documented_calls_give_what_horovods_documentation_says(ranks, n):
    total = n * (n + 1) // 2
    for r, out in enumerate(ranks(n, _documented_calls)):
        assert torch.equal(out["grouped"][0], torch.tensor([1.0, 2.0]) * total)
        assert out["grouped"][1].dtype == torch.int64 and out["grouped"][1].item() == total
        assert out["inputs unchanged"] and out["polled"]
        assert torch.allclose(out["averaged"][0], torch.tensor([1.0, 2.0]) * total / n)
        assert out["in place"] and out["in_place"][1].item() == 2 * total
        # what every rank q sent to r: rows of q's tensor from sum(splits_q[:r]) on
        want = []
        for q in range(n):
            split = [(q + p) % 3 for p in range(n)]
            start = sum(split[:r])
            want += [float(100 * q + start + i) for i in range(split[r])]
        assert out["alltoall"].squeeze(1).tolist() == want
        # 7 rows over n ranks: the first 7 % n ranks get one row more
        base, extra = divmod(7, n)
        start = r * base + min(r, extra)
        whole = torch.arange(14.0).reshape(7, 2) * total
        assert torch.equal(out["reducescatter"], whole[start : start + base + (r < extra)])
        assert out["broadcast_object"] == {"from": n - 1, "list": [n - 1]}
        assert out["allgather_object"] == [("rank", q) for q in range(n)]
        want_sparse = torch.zeros(n + 1)
        want_sparse[:n] = 1.0
        want_sparse[n] = total
        assert torch.equal(out["sparse"], want_sparse)


def test_the_build_queries_describe_this_build():
    import longboat.horovod.torch as hvd

    assert hvd.gloo_built() is hvd.gloo_enabled() is torch.distributed.is_gloo_available()
    assert hvd.nccl_built() is torch.distributed.is_nccl_available()
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert hvd.rocm_built() is (torch.version.hip is not None)
    assert not (hvd.mpi_built() or hvd.mpi_enabled() or hvd.ccl_built() or hvd.ddl_built())
    with pytest.raises(ValueError, match="MPI"):
        hvd.mpi_threads_supported()


def test_init_works_again_after_shutdown_even_after_a_failed_collective():
    res = harness.longboat_run("-n", "2", str(SCRIPTS / "horovod_reinit.py"))
    assert res.returncode == 0, res.stdout
    lines = [ln.split("]: ", 1)[-1] for ln in res.stdout.splitlines() if '"cycles"' in ln]
    assert len(lines) == 2, res.stdout
    for line in lines:
        first, second = json.loads(line)["cycles"]
        assert "Mismatched allreduce tensor shapes" in first["error"], first
        assert first["sum"] == second["sum"] == 3.0 and first["size"] == second["size"] == 2
        assert second["error"] == ""


def _process_sets() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    evens = hvd.add_process_set([0, 2])
    out: dict = {"size": evens.size(), "rank": evens.rank(), "included": evens.included()}
    try:
        if evens.included():
            x = torch.tensor([float(r + 1)])
            out["sum"] = hvd.allreduce(x, op=hvd.Sum, process_set=evens).item()
            out["gather"] = hvd.allgather(torch.full((r + 1,), r), process_set=evens).tolist()
            out["bcast"] = hvd.broadcast(x, root_rank=2, process_set=evens).item()
            out["object"] = hvd.allgather_object(r, process_set=evens)
            try:
                hvd.allreduce(torch.ones(1 + r), process_set=evens)
            except hvd.HorovodInternalError as e:
                out["error"] = str(e)
        else:
            try:
                hvd.allreduce(torch.ones(1), process_set=evens)
            except ValueError as e:
                out["error"] = str(e)
        out["global"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    finally:
        hvd.remove_process_set(evens)
    return out


def test_process_sets_run_and_check_collectives_among_their_ranks(ranks):
    got = ranks(3, _process_sets)
    for r in (0, 2):
        out = got[r]
        assert out["size"] == 2 and out["rank"] == r // 2 and out["included"]
        assert out["sum"] == 4.0 and out["bcast"] == 3.0 and out["object"] == [0, 2]
        assert out["gather"] == [0, 2, 2, 2]
        assert "Mismatched allreduce tensor shapes" in out["error"], out
        assert "rank 0: [[1]]; rank 1: [[3]]" in out["error"], out  # ranks within the set
    assert not got[1]["included"] and got[1]["rank"] == -1
    assert "rank 1 is not in ProcessSet([0, 2])" in got[1]["error"], got[1]
    assert all(out["global"] == 3.0 for out in got)


def _joined_rank_serves() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {}
    if r == n - 1:
        out["last"] = hvd.join()
        return out
    a, b = torch.tensor([1.0, 2.0]) * (r + 1), torch.tensor([r + 1], dtype=torch.int16)
    out["grouped"] = [t.tolist() for t in hvd.grouped_allreduce([a, b], op=hvd.Sum)]
    out["average"] = hvd.allreduce(a, op=hvd.Average).tolist()
    try:
        hvd.broadcast(a, root_rank=0)
    except hvd.HorovodInternalError as e:
        out["error"] = str(e)
    out["last"] = hvd.join()
    return out


def test_a_joined_rank_serves_grouped_allreduces_with_zeros_and_refuses_broadcasts(ranks):
    got = ranks(3, _joined_rank_serves)
    for out in got[:2]:  # ranks 0 and 1: rank 2 joined, its zeros count in the average
        assert out["grouped"] == [[3.0, 6.0], [3]]
        assert out["average"] == pytest.approx([1.0, 2.0])
        assert "hvd.broadcast while rank(s) [2] have called hvd.join()" in out["error"], out
    assert [out["last"] for out in got] == [1, 1, 1]  # 0 and 1 joined together: the highest
