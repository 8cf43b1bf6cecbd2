"""``hvd.join()``: ranks that ran out of data take part in the others' allreduces with zeros.

[Note: Horovod join] Horovod's coordinator tells a joined rank which tensors the others reduce
next, and the joined rank reduces zeros of the same sizes until every rank has joined. Here
the exchange that begins every round of collectives ([Note: Horovod negotiation] in
negotiate.py) plays the coordinator: a rank in :func:`join` takes part in each exchange as
"joined", reads from it what the active ranks reduce (the dtypes and shapes of their requests:
the asynchronous allreduces the round starts, in its order, then the collective they are in),
and reduces zeros of those, flattened as theirs are (:func:`start_flat_allreduce`), until an
exchange finds every rank joined. A rank outside :func:`join` is active in every exchange.

* **Average divides by all ranks.** Horovod scales an Average by the process set's size
  whatever the number of joined ranks (its gloo, MPI and NCCL ops divide by
  ``controller->GetSize()``, and its own join test expects ``tensor * (size - 1) / size`` with
  one rank joined), so a joined rank's zeros count in the average: the result is the sum over
  the active ranks divided by ``hvd.size()``. Sum is the sum over the active ranks.
* **What cannot take part.** Horovod refuses allgather and alltoall while a rank has joined; so
  does this module, and it refuses broadcasts, barriers, reducescatter and Adasum too (a joined
  rank has nothing to broadcast, and Adasum's result depends on which ranks take part): every
  active rank raises the same error naming the collective and the joined ranks, instead of
  hanging, and the joined ranks stay in :func:`join`, serving the rounds that follow, as
  Horovod's do.
* **The rank that joined last.** :func:`join` returns it on every rank: the ranks whose first
  exchange as joined is the one that finds every rank joined joined last; when several did
  (they joined between the same two rounds), the highest of them is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longboat.horovod import wire
from longboat.horovod.negotiate import HorovodInternalError, Request, dtype_of
from longboat.horovod.process_sets import Where


def _joinable(q: Request) -> bool:
    """Whether a joined rank takes part in ``q`` (with zeros): allreduces but Adasum's."""
    return q.op == "allreduce" and q.reduce != "adasum"


def _what(q: Request) -> str:
    return f"{q.op}(op={q.reduce})" if q.reduce == "adasum" else q.op


def _refuse(what: str, joined: list[int]) -> HorovodInternalError:
    return HorovodInternalError(
        f"hvd.{what} while rank(s) {joined} have called hvd.join(): a joined rank takes part "
        "only in allreduces with op Average or Sum (hvd.allreduce, grouped_allreduce, "
        f"DistributedOptimizer), as in Horovod; call hvd.{what} after hvd.join() has returned "
        "on every rank"
    )


def announce(mine: Request, at: Where) -> None:
    """An active rank's exchange before a round of collectives of the global set ``at``. Raises
    on every rank when the ranks' requests differ, or a rank has joined and the round is not one
    it can take part in."""
    r = at.queue.announce(mine, at.control, at.size)
    if r.joined and not _joinable(mine):
        raise _refuse(_what(mine), r.joined)


def start_flat_allreduce(
    tensors: list[torch.Tensor], over: dist.ProcessGroup | None = None
) -> tuple[list[Any], Callable[[], None]]:
    """Start summing ``tensors`` across ranks, flattened into one buffer per dtype in the order
    the dtypes first appear ([Note: Horovod wire dtypes] in wire.py for those gloo lacks);
    returns the works under way and a function that waits for them and writes the sums back
    into ``tensors``. ``over``: a process set's group (the default group if None)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    pending = []
    for group in groups.values():
        flat = torch.cat([wire.reduce_form(t).reshape(-1) for t in group])
        pending.append((group, flat, dist.all_reduce(flat, group=over, async_op=True)))

    def finish() -> None:
        for group, flat, work in pending:
            if work is not None:
                work.wait()
            offset = 0
            for t in group:
                part = flat[offset : offset + t.numel()]
                if t.dtype == torch.uint64:  # summed as the int64 with the same bits
                    part = part.view(torch.uint64)
                t.copy_(part.view(t.shape))
                offset += t.numel()

    return [work for _, _, work in pending], finish


def join(device: torch.device, at: Where) -> int:
    """Take part in each round of the global set ``at`` as "joined", reducing zeros in the
    active ranks' allreduces, until every rank has joined; returns the rank that joined last
    ([Note: Horovod join])."""
    fresh = True
    while True:
        r = at.queue.round(at.control, at.size, active=False, fresh=fresh)
        fresh = False
        if not any(r.active):
            return max(i for i, f in enumerate(r.fresh) if f)
        # What the active ranks start this round, in their order: their pending asynchronous
        # allreduces, then the collective they are all in ([Note: Horovod pending operations]
        # in pending.py); one this rank cannot take part in makes them raise (announce).
        for q in r.run:
            if _joinable(q):
                zeros = [
                    torch.zeros(tuple(d or 0 for d in shape), dtype=dtype_of(dt), device=device)
                    for dt, shape in zip(q.dtypes, q.shapes, strict=True)
                ]
                start_flat_allreduce(zeros, at.group)[1]()
