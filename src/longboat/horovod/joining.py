"""``hvd.join()``: ranks that ran out of data take part in the others' allreduces with zeros.

[Note: Horovod join] Horovod's coordinator tells a joined rank which tensors the others reduce
next, and the joined rank reduces zeros of the same sizes until every rank has joined. Here
there is no coordinator, so every round of collectives of ``longboat.horovod.torch`` (one direct
``hvd.allreduce``, one ``DistributedOptimizer`` step, one allgather, broadcast, alltoall or
barrier) begins with a **vote**: one small all-reduce of an int64 vector on the default group
in which every rank says whether it is active, and the active ranks say what the round is (an
allreduce, or another collective) and how many elements of each dtype it reduces. A joined rank
sits in :func:`join`, voting "joined" and then reducing zeros of those sizes (one buffer per
dtype, in ``DTYPES`` order, as the active ranks flatten theirs), until a vote finds every rank
joined. A rank outside :func:`join` is active in every vote; the vote costs one small collective
per round whether or not any rank ever joins, since no rank can know beforehand that none will.

* **Average divides by all ranks.** Horovod scales an Average by the process set's size
  whatever the number of joined ranks (its gloo, MPI and NCCL ops divide by
  ``controller->GetSize()``, and its own join test expects ``tensor * (size - 1) / size`` with
  one rank joined), so a joined rank's zeros count in the average: the result is the sum over
  the active ranks divided by ``hvd.size()``. Sum is the sum over the active ranks.
* **What cannot take part.** Horovod refuses allgather and alltoall while a rank has joined; so
  does this module, and it refuses broadcasts, barriers and Adasum too (a joined rank has
  nothing to broadcast, and Adasum's result depends on which ranks take part): every rank,
  joined or not, raises the same error naming the collective, instead of hanging.
* **The rank that joined last.** :func:`join` returns it on every rank: the ranks whose first
  vote as joined is the vote that finds every rank joined joined last; when several did (they
  joined between the same two rounds), the highest of them is returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

#: The dtypes a reduction may carry, in the order their flat buffers are reduced in a round.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
)

# What a round is, as the active ranks vote it (the same on every active rank).
ALLREDUCE, ADASUM, OTHER = 1, 2, 3


@dataclass(frozen=True)
class Round:
    """What one vote found."""

    active: tuple[bool, ...]
    fresh: tuple[bool, ...]  # whose first vote as joined this was
    kind: int
    numels: tuple[int, ...]  # elements reduced per dtype of DTYPES

    @property
    def joined(self) -> list[int]:
        return [r for r, a in enumerate(self.active) if not a]


def _vote(device: torch.device, active: bool, fresh: bool, kind: int, numels: list[int]) -> Round:
    size, rank = dist.get_world_size(), dist.get_rank()
    v = torch.zeros(2 * size + 1 + len(DTYPES), dtype=torch.int64)
    if active:
        v[rank] = 1
        v[2 * size] = kind
        v[2 * size + 1 :] = torch.tensor(numels, dtype=torch.int64)
    if fresh:
        v[size + rank] = 1
    v = v.to(device)
    dist.all_reduce(v)
    vals = v.tolist()
    count = sum(vals[:size])
    said = vals[2 * size :]
    if count and any(x % count for x in said):
        raise RuntimeError(
            "longboat.horovod: the active ranks started different collectives in the same "
            "round (a different op, or tensors of different sizes or dtypes); every rank must "
            "issue the same collectives in the same order"
        )
    said = [x // count for x in said] if count else [0] * len(said)
    return Round(
        active=tuple(bool(x) for x in vals[:size]),
        fresh=tuple(bool(x) for x in vals[size : 2 * size]),
        kind=said[0],
        numels=tuple(said[1:]),
    )


def _refuse(what: str, joined: list[int]) -> RuntimeError:
    return RuntimeError(
        f"hvd.{what} while rank(s) {joined} have called hvd.join(): a joined rank takes part "
        "only in allreduces with op Average or Sum (hvd.allreduce, DistributedOptimizer), as in "
        f"Horovod; call hvd.{what} after hvd.join() has returned on every rank"
    )


def numels_of(tensors: list[torch.Tensor]) -> list[int]:
    """Elements per dtype of DTYPES in ``tensors``."""
    out = [0] * len(DTYPES)
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"longboat.horovod reduces {', '.join(map(str, DTYPES))}: {t.dtype}")
        out[DTYPES.index(t.dtype)] += t.numel()
    return out


def announce(kind: int, numels: list[int], device: torch.device, what: str) -> None:
    """An active rank's vote before a round of collectives: ``what`` for errors. Raises on every
    rank when a rank has joined and the round is not an allreduce joined ranks can take part in."""
    r = _vote(device, True, False, kind, numels)
    if r.joined and kind != ALLREDUCE:
        raise _refuse(what, r.joined)


def flat_allreduce(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` across ranks in place, flattened into one buffer per dtype of DTYPES, in
    that order: the buffers a joined rank reduces zeros into ([Note: Horovod join])."""
    for dtype in DTYPES:
        group = [t for t in tensors if t.dtype == dtype]
        if not group:
            continue
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def join(device: torch.device) -> int:
    """Vote "joined" and reduce zeros in each round the active ranks start, until every rank
    has joined; returns the rank that joined last ([Note: Horovod join])."""
    fresh = True
    while True:
        r = _vote(device, False, fresh, 0, [0] * len(DTYPES))
        fresh = False
        if not any(r.active):
            return max(i for i, f in enumerate(r.fresh) if f)
        if r.kind != ALLREDUCE:
            what = "allreduce(op=Adasum)" if r.kind == ADASUM else "collective other than allreduce"
            raise _refuse(what, r.joined)
        sizes = zip(DTYPES, r.numels, strict=True)
        flat_allreduce([torch.zeros(n, dtype=d, device=device) for d, n in sizes if n])
