"""Horovod's collectives on ``torch.distributed`` ([Note: Horovod API] in torch.py).

Each begins with the exchange of [Note: Horovod negotiation] (negotiate.py), so ranks that
disagree get an error on every rank, and a rank in ``hvd.join()`` can follow
([Note: Horovod join] in joining.py); asynchronous allreduces wait in their process set's
queue until the ranks agree on them by name ([Note: Horovod pending operations] in
pending.py); dtypes gloo lacks travel as [Note: Horovod wire dtypes] (wire.py) says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longboat.horovod import adasum, joining, negotiate, wire
from longboat.horovod.compression import Compression
from longboat.horovod.pending import Entry
from longboat.horovod.process_sets import ProcessSet, Where, where

# Reduction ops, as Horovod names them.
Average, Sum, Adasum = "average", "sum", "adasum"


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _announce(mine: negotiate.Request, at: Where) -> None:
    """The exchange before a round ([Note: Horovod negotiation]); a joined rank follows the
    global set's rounds only ([Note: Horovod process sets])."""
    if at.size > 1:
        if at.is_global:
            joining.announce(mine, at)
        else:
            at.queue.announce(mine, at.control, at.size)


class Handle:
    """An asynchronous operation: :func:`synchronize` gives its result, :func:`poll` says
    whether it has finished without waiting. ``finish`` waits for the operation's works and
    gives its result; ``entry``: its place in ``at``'s queue while the ranks have not yet
    agreed on it ([Note: Horovod pending operations] in pending.py)."""

    def __init__(
        self, finish: Callable[[], Any], entry: Entry | None = None, at: Where | None = None
    ) -> None:
        self.works: list[Any] = []
        self.finish, self.entry, self.at = finish, entry, at
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        if self._done:
            return True
        if self.entry is not None:
            assert self.at is not None
            if not self.at.queue.poll(self.entry, self.at.control, self.at.size):
                return False
        return all(w.is_completed() for w in self.works)

    def wait(self) -> Any:
        if not self._done:
            if self.entry is not None:
                assert self.at is not None
                self.at.queue.synchronize(self.entry, self.at.control, self.at.size)
            for w in self.works:
                w.wait()
            self._result, self._done = self.finish(), True
        return self._result


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its result."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Whether ``handle``'s operation has finished (``synchronize`` will not wait)."""
    return handle.poll()


def _op(average: bool | None, op: str | None) -> str:
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op={op!r}: use hvd.Average, hvd.Sum or hvd.Adasum")
    return op


# -- allreduce -------------------------------------------------------------------------------------


def _allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
    process_set: ProcessSet | None = None,
    *,
    queued: bool,
    what: str,
) -> Handle:
    """Reduce each of ``tensors`` in place across ranks (of ``process_set``), all in one round
    (one buffer per dtype); the handle's result is the list of tensors. ``queued``: wait in the
    queue to be matched by name ([Note: Horovod pending operations] in pending.py) instead of
    being announced now, in issue order."""
    op = _op(average, op)
    at = where(process_set, what)
    if op == Adasum:  # combined at once: Adasum's rounds are blocking ones
        _announce(negotiate.request("allreduce", tensors, name=name, reduce=Adasum), at)
        for t in tensors:
            t.copy_(_adasum(t, at))
        return Handle(lambda: tensors)
    wires = [
        compression.compress(t * prescale_factor if prescale_factor != 1 else t) for t in tensors
    ]
    finish_sum: list[Callable[[], None]] = []

    def finish() -> list[torch.Tensor]:
        for f in finish_sum:
            f()
        scale = postscale_factor / (at.size if op == Average else 1)
        for t, (w, dtype) in zip(tensors, wires, strict=True):
            out = compression.decompress(w, dtype)
            if scale != 1:
                t.copy_(out * scale)
            elif out is not t:
                t.copy_(out)
        return tensors

    handle = Handle(finish)

    def start() -> None:
        works, f = joining.start_flat_allreduce([w for w, _ in wires], at.group)
        handle.works, finish_sum[:] = works, [f]

    if at.size == 1:
        return handle
    mine = negotiate.request("allreduce", [w for w, _ in wires], name=name, reduce=op)
    if queued:
        handle.entry, handle.at = at.queue.add(mine, start, what), at
    else:
        _announce(mine, at)
        start()
    return handle


def grouped_allreduce_async_(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Handle:
    """Start reducing each of ``tensors`` in place across ranks, in one round, once every rank
    has issued an operation of this name (in any order: [Note: Horovod pending operations] in
    pending.py); the handle's result is the list of tensors."""
    return _allreduce(tensors, *args, queued=True, what="grouped_allreduce_async_", **kwargs)


def grouped_allreduce_async(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Handle:
    copies = [t.detach().clone() for t in tensors]
    return _allreduce(copies, *args, queued=True, what="grouped_allreduce_async", **kwargs)


def grouped_allreduce_(
    tensors: list[torch.Tensor], *args: Any, **kwargs: Any
) -> list[torch.Tensor]:
    handle = _allreduce(tensors, *args, queued=False, what="grouped_allreduce_", **kwargs)
    return handle.wait()  # type: ignore[no-any-return]


def grouped_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced across ranks (averaged by default), as new tensors, in one
    round."""
    return grouped_allreduce_([t.detach().clone() for t in tensors], *args, **kwargs)


def _first(handle: Handle) -> Handle:
    """``handle`` of a one-tensor group, giving the tensor itself."""
    finish = handle.finish
    handle.finish = lambda: finish()[0]
    return handle


def allreduce_async_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """Start reducing ``tensor`` in place across ranks, once every rank has issued an operation
    of this name ([Note: Horovod pending operations] in pending.py)."""
    return _first(_allreduce([tensor], *args, queued=True, what="allreduce_async_", **kwargs))


def allreduce_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """Start reducing a copy of ``tensor``."""
    copy = tensor.detach().clone()
    return _first(_allreduce([copy], *args, queued=True, what="allreduce_async", **kwargs))


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    handle = _allreduce([tensor], *args, queued=False, what="allreduce_", **kwargs)
    return handle.wait()[0]  # type: ignore[no-any-return]


def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor`` reduced across ranks (averaged by default), as a new tensor."""
    return allreduce_(tensor.detach().clone(), *args, **kwargs)


def _adasum(tensor: torch.Tensor, at: Where) -> torch.Tensor:
    """Every rank's ``tensor`` combined by [Note: Adasum], the same on every rank."""
    if at.size == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(at.size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=at.group)
    return adasum.tree(parts)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """``tensor`` reduced across ranks, split along dim 0: rank r gets its part, the first
    ``rows % size`` ranks one row more than the others, as in Horovod."""
    op = _op(None, op)
    if op == Adasum:
        raise ValueError("reducescatter: op=hvd.Adasum is not supported; use Average or Sum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: a 0-d tensor has no first dimension to scatter")
    at = where(process_set, "reducescatter")
    whole = allreduce(tensor, name=name, op=op, process_set=process_set)
    base, extra = divmod(tensor.shape[0], at.size)
    start = at.rank * base + min(at.rank, extra)
    return whole[start : start + base + (at.rank < extra)].clone()


# -- moves -----------------------------------------------------------------------------------------


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (first dims may differ)."""
    at = where(process_set, "allgather")
    if at.size == 1:
        return tensor.clone()
    _announce(negotiate.request("allgather", [tensor], name=name, ragged=True), at)
    rows = wire.as_rows(tensor)
    counts = [torch.empty(1, dtype=torch.int64) for _ in range(at.size)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64), group=at.control)
    n = [int(c) for c in counts]
    padded = torch.zeros((max(n), rows.shape[1]), dtype=rows.dtype, device=tensor.device)
    padded[: n[at.rank]] = rows
    parts = [torch.empty_like(padded) for _ in range(at.size)]
    dist.all_gather(parts, padded, group=at.group)
    out = torch.cat([p[:k] for p, k in zip(parts, n, strict=True)])
    return wire.from_rows(out, tensor.dtype, tuple(tensor.shape[1:]))


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` copied into ``tensor`` on every rank (of ``process_set``;
    ``root_rank`` is the root's global rank, as in Horovod)."""
    at = where(process_set, "broadcast")
    _check_root(root_rank, process_set)
    if at.size > 1:
        _announce(negotiate.request("broadcast", [tensor], name=name, root=root_rank), at)
        if wire.carried(tensor.dtype) and tensor.is_contiguous():
            dist.broadcast(tensor, src=root_rank, group=at.group)
        else:
            rows = wire.as_rows(tensor).clone()
            dist.broadcast(rows, src=root_rank, group=at.group)
            tensor.copy_(rows.view(tensor.dtype).reshape(tensor.shape))
    return tensor


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor."""
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set)


def _check_root(root_rank: int, process_set: ProcessSet | None) -> None:
    members = (process_set or ProcessSet()).members()
    if root_rank not in members:
        raise ValueError(f"root_rank={root_rank}: use one of the ranks {members}")


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Rank r sends ``splits[j]`` rows (dim 0) of ``tensor`` to rank j (equal parts without
    ``splits``) and gets back the rows every rank sent it, in rank order."""
    at = where(process_set, "alltoall")
    k = at.size
    if splits is None and tensor.shape[0] % k:
        raise ValueError(
            f"alltoall: {tensor.shape[0]} rows do not split evenly over {k} ranks; pass splits"
        )
    send = [int(s) for s in splits] if splits is not None else [tensor.shape[0] // k] * k
    if len(send) != k or min(send) < 0 or sum(send) != tensor.shape[0]:
        raise ValueError(
            f"alltoall: splits {send} must be {k} non-negative counts adding up to "
            f"{tensor.shape[0]} rows"
        )
    if k == 1:
        return tensor.clone()
    _announce(negotiate.request("alltoall", [tensor], name=name, ragged=True), at)
    recv_counts = torch.empty(k, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.tensor(send, dtype=torch.int64), group=at.control)
    recv = [int(c) for c in recv_counts]
    rows = wire.as_rows(tensor)
    out = torch.empty((sum(recv), rows.shape[1]), dtype=rows.dtype, device=tensor.device)
    dist.all_to_all_single(out, rows, recv, send, group=at.group)
    return wire.from_rows(out, tensor.dtype, tuple(tensor.shape[1:]))


def barrier(process_set: ProcessSet | None = None) -> None:
    at = where(process_set, "barrier")
    if at.size > 1:
        _announce(negotiate.request("barrier"), at)
        dist.barrier(group=at.group)


# -- objects ---------------------------------------------------------------------------------------


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> Any:
    """``root_rank``'s ``obj`` (picklable) on every rank."""
    at = where(process_set, "broadcast_object")
    _check_root(root_rank, process_set)
    box = [obj]
    if at.size > 1:
        _announce(negotiate.request("broadcast_object", name=name, root=root_rank), at)
        dist.broadcast_object_list(box, src=root_rank, group=at.control)
    return box[0]


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = None
) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    at = where(process_set, "allgather_object")
    if at.size == 1:
        return [obj]
    _announce(negotiate.request("allgather_object", name=name), at)
    out: list[Any] = [None] * at.size
    dist.all_gather_object(out, obj, group=at.control)
    return out


# -- sparse ----------------------------------------------------------------------------------------


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: ProcessSet | None = None,
) -> Handle:
    """Start reducing a sparse COO ``tensor``: every rank's entries gathered (indices and values
    by allgather, as Horovod does), duplicates summed; Average divides by the number of ranks."""
    op = _op(None, op)
    if op == Adasum:
        raise ValueError("sparse_allreduce: op=hvd.Adasum is not supported; use Average or Sum")
    t = tensor.coalesce()
    ps = process_set
    indices = t.indices().t().contiguous()
    indices = allgather(indices, f"{name}.indices" if name else None, ps)
    values = allgather(t.values(), f"{name}.values" if name else None, ps)
    out = torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce()
    result = out / where(ps, "sparse_allreduce").size if op == Average else out
    return Handle(lambda: result)


def sparse_allreduce(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """A sparse ``tensor`` reduced across ranks (see :func:`sparse_allreduce_async`)."""
    return sparse_allreduce_async(tensor, name, op, process_set).wait()  # type: ignore[no-any-return]
