"""Before each round of collectives the ranks compare what they are about to do.

[Note: Horovod negotiation] Horovod's coordinator checks that every rank submitted the same
operation for a tensor name (same op, dtype, shape, root rank) and, when they differ, fails
the operation on every rank with a message naming the ranks. Plain gloo does none of that: two
ranks that reduce tensors of different sizes abort the process or hang, and float32 on one rank
against int32 of the same size on the other "succeeds" with garbage. So each round here (one
``hvd.allreduce``, one grouped allreduce, one ``DistributedOptimizer`` step, one allgather,
broadcast, alltoall, reducescatter, object exchange or barrier) begins with an exchange on the
control plane (a gloo group; the default group itself under gloo):

1. every rank all-gathers a header of four int64s: active (0 when it sits in ``hvd.join()``),
   "first exchange as joined", the length of its request in JSON, and a 56-bit hash of that JSON;
2. only when the active ranks' hashes differ, or some rank has joined, every rank all-gathers
   the requests themselves (JSON bytes, padded to the longest): then every rank holds the same
   requests and raises the same :class:`HorovodInternalError` naming what differs, rank by
   rank, or (a joined rank) learns which tensors the active ranks reduce ([Note: Horovod join]
   in joining.py).

The common case therefore costs one all-gather of ``4 * size`` int64s per round. A request
holds what must agree (the op, the name the user gave, the reduction, the root rank, each
tensor's dtype and shape, the first dimension left out where ranks may differ in it: allgather,
alltoall). Every rank decides from the same gathered data, so either every rank raises or none
does, and no rank is left waiting in a collective its peers never enter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed on every rank (a ``RuntimeError``)."""


@dataclass(frozen=True)
class Request:
    """What a rank is about to do in one round: what every active rank must agree on."""

    op: str
    name: str = ""
    reduce: str = ""
    root: int = -1
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int | None, ...], ...] = ()

    def encode(self) -> bytes:
        return json.dumps(
            [self.op, self.name, self.reduce, self.root, self.dtypes, self.shapes]
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        op, name, reduce, root, dtypes, shapes = json.loads(data)
        return cls(op, name, reduce, root, tuple(dtypes), tuple(tuple(s) for s in shapes))


def request(
    op: str,
    tensors: list[torch.Tensor] = (),  # type: ignore[assignment]
    *,
    name: str | None = None,
    reduce: str = "",
    root: int = -1,
    ragged: bool = False,
) -> Request:
    """The request for ``op`` on ``tensors``; ``ragged``: their first dimensions may differ."""

    def shape(t: torch.Tensor) -> tuple[int | None, ...]:
        dims: tuple[int | None, ...] = tuple(t.shape)
        return (None, *dims[1:]) if ragged and dims else dims

    return Request(
        op=op,
        name=name or "",
        reduce=reduce,
        root=root,
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        shapes=tuple(shape(t) for t in tensors),
    )


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a request names."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


@dataclass(frozen=True)
class Round:
    """What one exchange found, the same on every rank."""

    active: tuple[bool, ...]
    fresh: tuple[bool, ...]  # whose first exchange as joined this was
    request: Request | None  # what the active ranks agreed on; None when every rank joined

    @property
    def joined(self) -> list[int]:
        return [r for r, a in enumerate(self.active) if not a]


_CONTROL: dict[int, dist.ProcessGroup] = {}


def control() -> dist.ProcessGroup | None:
    """The control plane: the default group under gloo, else one gloo group over the same
    ranks, made on first use (a collective every rank reaches in the same round) and kept per
    default group, so a later ``init()`` gets a fresh one."""
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    assert world is not None
    if id(world) not in _CONTROL:
        _CONTROL.clear()
        _CONTROL[id(world)] = dist.new_group(backend="gloo")
    return _CONTROL[id(world)]


def forget() -> None:
    """Drop the control group before the default group is destroyed (``hvd.shutdown``)."""
    _CONTROL.clear()


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def exchange(
    mine: Request | None,
    fresh: bool = False,
    group: dist.ProcessGroup | None = None,
    size: int | None = None,
) -> Round:
    """Every rank's request for this round ([Note: Horovod negotiation]); ``mine`` is None on a
    rank in ``hvd.join()``. Raises :class:`HorovodInternalError` on every rank when the active
    ranks' requests differ. ``group`` and ``size``: a process set's control group and size
    (the whole world's by default)."""
    if size is None:
        size, group = dist.get_world_size(), control()
    body = mine.encode() if mine is not None else b""
    header = torch.tensor([mine is not None, fresh, len(body), _hash(body)], dtype=torch.int64)
    headers = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(headers, header, group=group)
    rows = [h.tolist() for h in headers]
    active = tuple(bool(r[0]) for r in rows)
    fresh_all = tuple(bool(r[1]) for r in rows)
    if not any(active):
        return Round(active, fresh_all, None)
    if all(active) and len({r[3] for r in rows}) == 1:
        return Round(active, fresh_all, mine)
    longest = max(r[2] for r in rows)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else 0
    bufs = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    requests = {
        r: Request.decode(bytes(bufs[r][: rows[r][2]].tolist())) for r in range(size) if active[r]
    }
    if len(set(requests.values())) > 1:
        raise mismatch(requests)
    return Round(active, fresh_all, next(iter(requests.values())))


_FIELDS = (
    ("op", "operations"),
    ("name", "tensor names"),
    ("reduce", "reduction ops"),
    ("root", "root ranks"),
    ("dtypes", "data types"),
    ("shapes", "tensor shapes"),
)


def mismatch(requests: dict[int, Request]) -> HorovodInternalError:
    """The error every rank raises when the active ranks' ``requests`` differ: the first field
    that differs, rank by rank."""
    ops = sorted({q.op for q in requests.values()})
    field, what = next(
        (f, w) for f, w in _FIELDS if len({getattr(q, f) for q in requests.values()}) > 1
    )
    values = {r: getattr(q, field) for r, q in requests.items()}
    per_rank = "; ".join(f"rank {r}: {_show(v)}" for r, v in sorted(values.items()))
    return HorovodInternalError(
        f"Mismatched {'/'.join(ops)} {what}: the ranks disagree ({per_rank}). Every rank must "
        "issue the same collectives, with the same names, dtypes, shapes and root ranks, in "
        "the same order"
    )


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if value is None:
        return "*"
    return repr(value) if isinstance(value, str) else str(value)


__all__ = [
    "HorovodInternalError",
    "Request",
    "Round",
    "control",
    "exchange",
    "forget",
    "request",
]
