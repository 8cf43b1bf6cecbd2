"""Horovod's collectives on ``torch.distributed`` ([Note: Horovod API] in torch.py).

Each begins with the exchange of [Note: Horovod negotiation] (negotiate.py), so ranks that
disagree get an error on every rank, and a rank in ``hvd.join()`` can follow
([Note: Horovod join] in joining.py); dtypes gloo lacks travel as [Note: Horovod wire dtypes]
(wire.py) says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longboat.horovod import adasum, joining, negotiate, wire
from longboat.horovod.compression import Compression

# Reduction ops, as Horovod names them.
Average, Sum, Adasum = "average", "sum", "adasum"


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _announce(mine: negotiate.Request) -> None:
    if size() > 1:
        joining.announce(mine)


class Handle:
    """An asynchronous operation: :func:`synchronize` gives its result, :func:`poll` says
    whether it has finished without waiting."""

    def __init__(self, works: list[Any], finish: Callable[[], Any]) -> None:
        self.works, self.finish = works, finish
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        return self._done or all(w.is_completed() for w in self.works)

    def wait(self) -> Any:
        if not self._done:
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


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    """Start reducing each of ``tensors`` in place across ranks, all in one round (one buffer
    per dtype); the handle's result is the list of tensors."""
    op = _op(average, op)
    if op == Adasum:
        _announce(negotiate.request("allreduce", tensors, name=name, reduce=Adasum))
        for t in tensors:
            t.copy_(_adasum(t))
        return Handle([], lambda: tensors)
    wires = [
        compression.compress(t * prescale_factor if prescale_factor != 1 else t) for t in tensors
    ]
    _announce(negotiate.request("allreduce", [w for w, _ in wires], name=name, reduce=op))
    works, finish_sum = (
        joining.start_flat_allreduce([w for w, _ in wires]) if size() > 1 else ([], None)
    )

    def finish() -> list[torch.Tensor]:
        if finish_sum is not None:
            finish_sum()
        scale = postscale_factor / (size() if op == Average else 1)
        for t, (w, dtype) in zip(tensors, wires, strict=True):
            out = compression.decompress(w, dtype)
            if scale != 1:
                t.copy_(out * scale)
            elif out is not t:
                t.copy_(out)
        return tensors

    return Handle(works, finish)


def grouped_allreduce_async(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Handle:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], *args, **kwargs)


def grouped_allreduce_(
    tensors: list[torch.Tensor], *args: Any, **kwargs: Any
) -> list[torch.Tensor]:
    return grouped_allreduce_async_(tensors, *args, **kwargs).wait()  # type: ignore[no-any-return]


def grouped_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced across ranks (averaged by default), as new tensors, in one
    round."""
    return grouped_allreduce_async(tensors, *args, **kwargs).wait()  # type: ignore[no-any-return]


def allreduce_async_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """Start reducing ``tensor`` in place across ranks."""
    group = grouped_allreduce_async_([tensor], *args, **kwargs)
    return Handle(group.works, lambda: group.wait()[0])


def allreduce_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """Start reducing a copy of ``tensor``."""
    return allreduce_async_(tensor.detach().clone(), *args, **kwargs)


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return allreduce_async_(tensor, *args, **kwargs).wait()  # type: ignore[no-any-return]


def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor`` reduced across ranks (averaged by default), as a new tensor."""
    return allreduce_async(tensor, *args, **kwargs).wait()  # type: ignore[no-any-return]


def _adasum(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` combined by [Note: Adasum], the same on every rank."""
    if size() == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return adasum.tree(parts)


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: str = Average) -> torch.Tensor:
    """``tensor`` reduced across ranks, split along dim 0: rank r gets its part, the first
    ``rows % size`` ranks one row more than the others, as in Horovod."""
    op = _op(None, op)
    if op == Adasum:
        raise ValueError("reducescatter: op=hvd.Adasum is not supported; use Average or Sum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: a 0-d tensor has no first dimension to scatter")
    whole = allreduce(tensor, name=name, op=op) if size() > 1 else tensor.clone()
    base, extra = divmod(tensor.shape[0], size())
    start = rank() * base + min(rank(), extra)
    return whole[start : start + base + (rank() < extra)].clone()


# -- moves -----------------------------------------------------------------------------------------


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (first dims may differ)."""
    if size() == 1:
        return tensor.clone()
    _announce(negotiate.request("allgather", [tensor], name=name, ragged=True))
    rows = wire.as_rows(tensor)
    counts = [torch.empty(1, dtype=torch.int64) for _ in range(size())]
    dist.all_gather(
        counts, torch.tensor([rows.shape[0]], dtype=torch.int64), group=negotiate.control()
    )
    n = [int(c) for c in counts]
    padded = torch.zeros((max(n), rows.shape[1]), dtype=rows.dtype, device=tensor.device)
    padded[: n[rank()]] = rows
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded)
    out = torch.cat([p[:k] for p, k in zip(parts, n, strict=True)])
    return wire.from_rows(out, tensor.dtype, tuple(tensor.shape[1:]))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` copied into ``tensor`` on every rank."""
    _check_root(root_rank)
    if size() > 1:
        _announce(negotiate.request("broadcast", [tensor], name=name, root=root_rank))
        if wire.carried(tensor.dtype) and tensor.is_contiguous():
            dist.broadcast(tensor, src=root_rank)
        else:
            rows = wire.as_rows(tensor).clone()
            dist.broadcast(rows, src=root_rank)
            tensor.copy_(rows.view(tensor.dtype).reshape(tensor.shape))
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank={root_rank}: use a rank from 0 to {size() - 1}")


def alltoall(
    tensor: torch.Tensor, splits: torch.Tensor | None = None, name: str | None = None
) -> torch.Tensor:
    """Rank r sends ``splits[j]`` rows (dim 0) of ``tensor`` to rank j (equal parts without
    ``splits``) and gets back the rows every rank sent it, in rank order."""
    k = size()
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
    _announce(negotiate.request("alltoall", [tensor], name=name, ragged=True))
    recv_counts = torch.empty(k, dtype=torch.int64)
    dist.all_to_all_single(
        recv_counts, torch.tensor(send, dtype=torch.int64), group=negotiate.control()
    )
    recv = [int(c) for c in recv_counts]
    rows = wire.as_rows(tensor)
    out = torch.empty((sum(recv), rows.shape[1]), dtype=rows.dtype, device=tensor.device)
    dist.all_to_all_single(out, rows, recv, send)
    return wire.from_rows(out, tensor.dtype, tuple(tensor.shape[1:]))


def barrier() -> None:
    if size() > 1:
        _announce(negotiate.request("barrier"))
        dist.barrier()


# -- objects ---------------------------------------------------------------------------------------


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` (picklable) on every rank."""
    _check_root(root_rank)
    box = [obj]
    if size() > 1:
        _announce(negotiate.request("broadcast_object", name=name, root=root_rank))
        dist.broadcast_object_list(box, src=root_rank, group=negotiate.control())
    return box[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if size() == 1:
        return [obj]
    _announce(negotiate.request("allgather_object", name=name))
    out: list[Any] = [None] * size()
    dist.all_gather_object(out, obj, group=negotiate.control())
    return out


# -- sparse ----------------------------------------------------------------------------------------


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: str = Average
) -> Handle:
    """Start reducing a sparse COO ``tensor``: every rank's entries gathered (indices and values
    by allgather, as Horovod does), duplicates summed; Average divides by the number of ranks."""
    op = _op(None, op)
    if op == Adasum:
        raise ValueError("sparse_allreduce: op=hvd.Adasum is not supported; use Average or Sum")
    t = tensor.coalesce()
    indices = allgather(t.indices().t().contiguous(), name=f"{name}.indices" if name else None)
    values = allgather(t.values(), name=f"{name}.values" if name else None)
    out = torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce()
    result = out / size() if op == Average else out
    return Handle([], lambda: result)


def sparse_allreduce(
    tensor: torch.Tensor, name: str | None = None, op: str = Average
) -> torch.Tensor:
    """A sparse ``tensor`` reduced across ranks (see :func:`sparse_allreduce_async`)."""
    return sparse_allreduce_async(tensor, name, op).wait()  # type: ignore[no-any-return]
