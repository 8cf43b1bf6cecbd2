"""``longboat.horovod.torch`` against Horovod's documented contract, at 2 and 3 ranks: ranks that
disagree get an error on every rank ([Note: Horovod negotiation]), every dtype travels
([Note: Horovod wire dtypes]), and the calls Horovod documents (grouped allreduce, ragged
allgather, alltoall with splits, reducescatter, object exchange, sparse allreduce, build
queries) give what their documentation says. Expected values are computed here with plain torch.
"""

from __future__ import annotations

import pytest
import torch


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
