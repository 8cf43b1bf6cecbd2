"""Before each round of collectives the ranks compare what they are about to do.

[Note: Horovod negotiation] Horovod's coordinator checks that every rank submitted the same
operation for a tensor name (same op, dtype, shape, root rank) and, when they differ, fails
the operation on every rank with a message naming the ranks. Plain gloo does none of that: two
ranks that reduce tensors of different sizes abort the process or hang, and float32 on one rank
against int32 of the same size on the other "succeeds" with garbage. So each round here (one
``hvd.allreduce``, one grouped allreduce, one ``DistributedOptimizer`` step, one allgather,
broadcast, alltoall, reducescatter, object exchange or barrier; a ``synchronize`` or ``poll``
of an asynchronous allreduce not yet started) begins with an exchange on the control plane (a
gloo group; the default group itself under gloo). Each active rank offers an :class:`Offer`:
the collective it is in (``now``; none in synchronize or poll) and the asynchronous
operations it has issued and not yet started, by name, in its order ([Note: Horovod pending
operations] in pending.py).

1. every rank all-gathers a header of four int64s: active (0 when it sits in ``hvd.join()``),
   "first exchange as joined", the length of its offer in JSON, and a 56-bit hash of what
   must agree (``now`` and the pending list);
2. only when the active ranks' hashes differ, or some rank has joined, every rank all-gathers
   the offers themselves (JSON bytes, padded to the longest).

Then every rank holds the same offers and :func:`decide` finds the same :class:`Round` on every
rank: the pending operations every active rank has, started in the lowest active rank's order
(the ones whose requests differ between ranks fail instead, naming what differs), and ``now``
when every active rank is in the same collective (or :class:`HorovodInternalError`, rank by
rank, when they are in different ones). A round in which nothing can run while every active
rank waits is an error too: no rank could ever issue what its peers wait for. A joined rank
learns from the round which tensors the active ranks reduce ([Note: Horovod join] in
joining.py).

The common case (ranks that issue the same operations in the same order) costs one all-gather
of ``4 * size`` int64s per round. A request holds what must agree (the op, the name the user
gave, the reduction, the root rank, each tensor's dtype and shape, the first dimension left out
where ranks may differ in it: allgather, alltoall). Every rank decides from the same gathered
data, so either every rank raises or none does, and no rank is left waiting in a collective its
peers never enter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

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

    def row(self) -> list[object]:
        """The request as JSON values; :meth:`from_row` undoes it."""
        return [self.op, self.name, self.reduce, self.root, self.dtypes, self.shapes]

    @classmethod
    def from_row(cls, row: list[Any]) -> Request:
        op, name, reduce, root, dtypes, shapes = row
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
class Offer:
    """What an active rank brings to a round: the collective it is in (``now``; None in
    synchronize or poll), its asynchronous operations not yet started (``pending``, named, in
    the order it issued them), what it waits for, and whether it waits (False: in poll)."""

    now: Request | None = None
    pending: tuple[Request, ...] = ()
    waits_for: str = ""
    blocking: bool = True

    def agreed(self) -> bytes:
        """What the ranks' offers must share for the round to need no second exchange."""
        now = self.now.row() if self.now is not None else None
        return json.dumps([now, [q.row() for q in self.pending]]).encode()

    def encode(self) -> bytes:
        now = self.now.row() if self.now is not None else None
        rows = [q.row() for q in self.pending]
        return json.dumps([now, rows, self.waits_for, self.blocking]).encode()

    @classmethod
    def decode(cls, data: bytes) -> Offer:
        now, rows, waits_for, blocking = json.loads(data)
        pending = tuple(Request.from_row(q) for q in rows)
        return cls(None if now is None else Request.from_row(now), pending, waits_for, blocking)


@dataclass(frozen=True)
class Round:
    """What one exchange found, the same on every rank."""

    active: tuple[bool, ...]
    fresh: tuple[bool, ...]  # whose first exchange as joined this was
    started: tuple[Request, ...] = ()  # pending operations every active rank has, in order
    now: Request | None = None  # the collective every active rank is in, when they agree
    failed: dict[str, HorovodInternalError] = field(default_factory=dict)  # by pending name
    error: HorovodInternalError | None = None  # what every rank raises after starting the rest

    @property
    def joined(self) -> list[int]:
        return [r for r, a in enumerate(self.active) if not a]

    @property
    def run(self) -> tuple[Request, ...]:
        """What the active ranks run this round, in order."""
        return self.started + ((self.now,) if self.now is not None else ())


def decide(active: tuple[bool, ...], fresh: tuple[bool, ...], offers: dict[int, Offer]) -> Round:
    """The round the active ranks' ``offers`` give ([Note: Horovod negotiation]): a pure
    function of data every rank holds."""
    if not offers:
        return Round(active, fresh)
    lead = offers[min(offers)]
    names = {r: {q.name: q for q in o.pending} for r, o in offers.items()}
    started: list[Request] = []
    failed: dict[str, HorovodInternalError] = {}
    for q in lead.pending:
        if all(q.name in n for n in names.values()):
            same = {r: n[q.name] for r, n in names.items()}
            if len(set(same.values())) > 1:
                failed[q.name] = mismatch(same)
            else:
                started.append(q)
    nows = {r: o.now for r, o in offers.items()}
    now, error = None, None
    if all(q is not None for q in nows.values()):
        if len(set(nows.values())) > 1:
            error = mismatch({r: q for r, q in nows.items() if q is not None})
        else:
            now = lead.now
    idle = not (started or failed or now or error)
    if idle and all(o.blocking for o in offers.values()):
        error = stalled(offers)
    return Round(active, fresh, tuple(started), now, failed, error)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


class Gathering:
    """One round under way, started at once and never waited for until :meth:`finish` (``poll``
    must not wait for ranks that are not in a round yet): the headers' all-gather, then, when
    they show the offers differ, the offers' ([Note: Horovod negotiation]). ``offer`` is None
    on a rank in ``hvd.join()``; ``group`` and ``size``: the process set's control group (None:
    the default group) and size."""

    def __init__(
        self, offer: Offer | None, group: dist.ProcessGroup | None, size: int, fresh: bool = False
    ) -> None:
        self.offer, self.group, self.size = offer, group, size
        self.body = offer.encode() if offer is not None else b""
        agreed = _hash(offer.agreed()) if offer is not None else 0
        header = torch.tensor([offer is not None, fresh, len(self.body), agreed], dtype=torch.int64)
        self.headers = [torch.empty_like(header) for _ in range(size)]
        self.work = dist.all_gather(self.headers, header, group=group, async_op=True)
        self.rows: list[list[int]] | None = None
        self.bodies: list[torch.Tensor] = []
        self.bodies_work: Any = None

    def _read_headers(self) -> list[list[int]]:
        """The headers (they must have arrived); starts the offers' all-gather if needed."""
        if self.rows is None:
            self.rows = [h.tolist() for h in self.headers]
            active = [r[0] for r in self.rows]
            if any(active) and not (all(active) and len({r[3] for r in self.rows}) == 1):
                buf = torch.zeros(max(r[2] for r in self.rows), dtype=torch.uint8)
                if self.body:
                    buf[: len(self.body)] = torch.frombuffer(
                        bytearray(self.body), dtype=torch.uint8
                    )
                self.bodies = [torch.empty_like(buf) for _ in range(self.size)]
                self.bodies_work = dist.all_gather(self.bodies, buf, self.group, async_op=True)
        return self.rows

    def done(self) -> bool:
        """Whether :meth:`finish` would return without waiting."""
        if self.work is not None and not self.work.is_completed():
            return False
        self._read_headers()
        return bool(self.bodies_work is None or self.bodies_work.is_completed())

    def finish(self) -> Round:
        if self.work is not None:
            self.work.wait()
        rows = self._read_headers()
        if self.bodies_work is not None:
            self.bodies_work.wait()
        active = tuple(bool(r[0]) for r in rows)
        fresh = tuple(bool(r[1]) for r in rows)
        if not any(active):
            return Round(active, fresh)
        if not self.bodies:  # every rank active, every offer the same: this one
            assert self.offer is not None
            return decide(active, fresh, dict.fromkeys(range(self.size), self.offer))
        offers = {
            r: Offer.decode(bytes(self.bodies[r][: rows[r][2]].tolist()))
            for r in range(self.size)
            if active[r]
        }
        return decide(active, fresh, offers)


def exchange(
    offer: Offer | None, group: dist.ProcessGroup | None, size: int, fresh: bool = False
) -> Round:
    """One round, waiting for every rank ([Note: Horovod negotiation])."""
    return Gathering(offer, group, size, fresh).finish()


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


def stalled(offers: dict[int, Offer]) -> HorovodInternalError:
    """The error every rank raises when every active rank waits and no operation can run."""

    def waits(o: Offer) -> str:
        if o.now is None:
            what = f"for {o.waits_for!r}"
        else:
            what = f"in {o.now.op}" + (f" {o.now.name!r}" if o.now.name else "")
        names = _show(tuple(q.name for q in o.pending))
        return f"{what}, its async operations not started: {names}"

    per_rank = "; ".join(f"rank {r} waits {waits(o)}" for r, o in sorted(offers.items()))
    return HorovodInternalError(
        f"No collective can run: every rank waits for one its peers have not issued ({per_rank})."
        " Every rank must issue the collectives the others wait for, with the same names "
        "(asynchronous ones may be issued in any order before their synchronize)"
    )


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if value is None:
        return "*"
    return repr(value) if isinstance(value, str) else str(value)


__all__ = [
    "Gathering",
    "HorovodInternalError",
    "Offer",
    "Request",
    "Round",
    "decide",
    "exchange",
    "request",
]
