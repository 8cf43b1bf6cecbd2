"""What goes on the wire for each torch dtype: gloo carries only some of them.

[Note: Horovod wire dtypes] Horovod reduces and moves every dtype its frameworks have; gloo
refuses int16, the unsigned types above uint8 and the float8 types ("Invalid scalar type").
Moves (allgather, broadcast, alltoall) send such a tensor as its bytes, which is exact for any
dtype. Reductions cannot sum bytes: int16, uint16 and uint32 are summed as int64 and cast back
(the cast wraps as the narrow sum would), uint64 is summed as the int64 with the same bits
(two's-complement addition is the same modulo 2**64), and float8 is summed as float32 and
rounded back once, at the end.
"""

from __future__ import annotations

import torch

#: What gloo carries as it is (checked on torch 2.13's gloo).
GLOO_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


def carried(dtype: torch.dtype) -> bool:
    return dtype in GLOO_DTYPES


def reduce_form(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype gloo sums exactly as ``t``'s own dtype would (a copy when converted)."""
    if carried(t.dtype):
        return t
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    if t.is_floating_point():
        return t.to(torch.float32)
    return t.to(torch.int64)


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`reduce_form` gives a tensor of ``dtype``."""
    return reduce_form(torch.empty(0, dtype=dtype)).dtype


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D tensor of gloo-carried elements, one row per index of dim 0 (its bytes
    when gloo lacks its dtype); :func:`from_rows` undoes it."""
    rows = t.shape[0] if t.dim() else 1
    flat = t.contiguous().reshape(rows, -1)
    return flat if carried(t.dtype) else flat.view(torch.uint8)


def from_rows(rows: torch.Tensor, dtype: torch.dtype, row_shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor :func:`as_rows` sent, rows along dim 0, each of ``row_shape``."""
    out = rows if rows.dtype == dtype else rows.contiguous().view(dtype)
    return out.reshape(rows.shape[0], *row_shape)


__all__ = ["GLOO_DTYPES", "as_rows", "carried", "from_rows", "reduce_dtype", "reduce_form"]
