"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): each gradient matrix travels as two
thin factors.

Per matrix M (a parameter of two or more dimensions, viewed as ``shape[0] x rest``) whose
factors are smaller than itself, with error feedback and a warm-started Q:

    M += error;  P = M Q;  all-reduce P;  P = orthonormal(P) (QR);  Q = M^T P;  all-reduce Q
    M_hat = P Q^T;  error = M - M_hat / n;  M = M_hat

Both all-reduces sum pre-divided gradients (``M`` is this rank's gradient divided by the ``n``
ranks), so ``M_hat`` approximates the sum of every rank's ``M``, the average gradient. A rank's
residual is what its own ``M`` was not represented by: its share of ``M_hat`` is ``M_hat / n``
(as torch's ``powerSGD_hook`` keeps ``error = M - M_hat`` with undivided ``M`` and averaged
``M_hat``), so that the residuals sum to the approximation's error over the ranks.

Vectors, matrices too small to gain, and the elements no parameter covers are reduced exactly,
packed into P's all-reduce: two collectives per buffer. Q starts from a normal sample drawn by
a generator seeded with the buffer's key and the parameter's index, the same on every rank, and
then keeps the last step's reduced Q (one power iteration per step). Factors are computed in
fp32 whatever the gradients' dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from longboat.comm.commlog import COMPRESSED
from longboat.comm.compression.protocol import Span, Warmup, covered, replaced
from longboat.comm.protocol import Comm


def matrix_shape(shape: torch.Size, rank: int) -> tuple[int, int] | None:
    """``(rows, cols)`` if a gradient of ``shape`` is compressed at ``rank``, else None:
    vectors, and matrices whose factors would be no smaller than themselves, go exact."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = shape.numel() // rows
    if rank >= min(rows, cols) or rank * (rows + cols) >= rows * cols:
        return None
    return rows, cols


def initial_q(key: str, index: int, cols: int, rank: int) -> torch.Tensor:
    """Q's first value, the same on every rank: a normal sample from a generator seeded by the
    buffer's key and the parameter's index."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{index}".encode()))
    return torch.randn(cols, rank, generator=gen)


class PowerSGD(Warmup):
    """Rank-``rank`` PowerSGD with error feedback ([Note: compressed reduction])."""

    def __init__(self, rank: int, warmup_steps: int) -> None:
        super().__init__(warmup_steps)
        self.rank = rank
        self.error: dict[tuple[str, int], torch.Tensor] = {}
        self.q: dict[tuple[str, int], torch.Tensor] = {}

    def all_reduce(self, key: str, flat: torch.Tensor, spans: Sequence[Span], comm: Comm) -> None:
        if comm.world_size == 1:  # (the planner's meta doorways are not active but count)
            return
        end = covered(spans)
        mats: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (index, M in fp32, its view)
        exact: list[torch.Tensor] = []
        for i, (off, shape) in enumerate(spans):
            view = flat[off : off + shape.numel()]
            rc = matrix_shape(shape, self.rank)
            if rc is None:
                exact.append(view)
                continue
            m = view.view(rc).float()
            err = self.error.get((key, i))
            m = m + err if err is not None else m.clone()
            mats.append((i, m, view))
        if end < flat.numel():
            exact.append(flat[end:])
        ps = []
        for i, m, _ in mats:
            q = self.q.get((key, i))
            if q is None:
                q = initial_q(key, i, m.shape[1], self.rank).to(m.device)
            ps.append(m @ q)
        sent = torch.cat([p.flatten() for p in ps] + [e.float().flatten() for e in exact])
        comm.all_reduce(sent, tag=f"{COMPRESSED}: powersgd P, {key}")
        at = 0
        for j, p in enumerate(ps):
            ps[j] = sent[at : at + p.numel()].view_as(p)
            at += p.numel()
        for e in exact:
            e.copy_(sent[at : at + e.numel()].view_as(e))
            at += e.numel()
        if mats:
            ps = [torch.linalg.qr(p).Q for p in ps]
            qs = [m.T @ p for (_, m, _), p in zip(mats, ps, strict=True)]
            sent_q = torch.cat([q.flatten() for q in qs])
            comm.all_reduce(sent_q, tag=f"{COMPRESSED}: powersgd Q, {key}")
            at = 0
            for (i, m, view), p, q in zip(mats, ps, qs, strict=True):
                q = sent_q[at : at + q.numel()].view_as(q)
                at += q.numel()
                approx = p @ q.T
                self.error[(key, i)] = m - approx / comm.world_size
                self.q[(key, i)] = q.clone()
                view.copy_(approx.flatten())
        replaced(comm, flat)
