"""1-bit compression with error feedback on both sides of the reduction, as the compressed
all-reduce of 1-bit Adam (Tang et al. 2021) and DeepSpeed's ``compressed_allreduce``.

With n ranks the buffer's parameter elements are padded to n chunks of c elements (c a multiple
of 8). Each rank:

1. worker side: x = g + worker_error; every chunk j becomes its signs (one bit per element,
   packed eight to a byte) and one fp32 scale ``||x_j|| / sqrt(c)``; worker_error = x - that;
2. ``all_to_all``: rank r receives every rank's chunk r (c/8 + 4 bytes from each);
3. server side: y = the sum of the decompressed chunks + server_error; y is compressed the same
   way (one scale), server_error = y - that;
4. ``all_gather`` of the server chunks (c/8 + 4 bytes each), decompressed into the buffer.

Each rank moves ``(n-1)/n (c n/8 + 4n)`` bytes twice, against ``2(n-1)/n 4 c n`` for an exact
fp32 all-reduce: about 32x fewer. Elements no parameter covers (replicate's usage flags, ZeRO's
padding) are reduced exactly.

The same :class:`OneBit` serves 1-bit Adam (``longboat.optim.onebit_adam``), which calls
:meth:`OneBit.all_reduce` on each parameter's divided momentum over the data-parallel doorway,
one span covering the whole flat tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from longboat.comm.commlog import COMPRESSED
from longboat.comm.compression.protocol import Span, Warmup, covered, replaced
from longboat.comm.protocol import Comm


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of ``x`` (last dimension a multiple of 8) as bits, eight to a byte, the first
    element in the highest bit; 1 for x >= 0."""
    bits = (x >= 0).to(torch.uint8).view(*x.shape[:-1], -1, 8)
    return (bits << _shifts(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """±1.0 (fp32) from :func:`pack_signs`' bytes."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.view(*packed.shape[:-1], -1).float() * 2 - 1


def compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` as packed signs and one scale ``||row|| / sqrt(len)``; returns the
    bytes (packed signs, then the scale's four bytes, per row) and the decompressed rows."""
    scale = x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    signs = torch.where(x >= 0, 1.0, -1.0)
    wire = torch.cat([pack_signs(x), scale.float().contiguous().view(torch.uint8)], dim=-1)
    return wire, signs * scale


def decompress(wire: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`compress`' bytes back to fp32 values."""
    signs = unpack_signs(wire[..., :-4])
    scale = wire[..., -4:].contiguous().view(torch.float32)
    return signs * scale


class OneBit(Warmup):
    """1-bit compression with worker and server error feedback ([Note: compressed
    reduction])."""

    def __init__(self, warmup_steps: int) -> None:
        super().__init__(warmup_steps)
        self.worker_error: dict[str, torch.Tensor] = {}
        self.server_error: dict[str, torch.Tensor] = {}

    def all_reduce(self, key: str, flat: torch.Tensor, spans: Sequence[Span], comm: Comm) -> None:
        if comm.world_size == 1:  # (the planner's meta doorways are not active but count)
            return
        n = comm.world_size
        end = covered(spans)
        c = -(-end // (8 * n)) * 8  # elements per chunk, a multiple of 8
        x = torch.zeros(n * c, dtype=torch.float32, device=flat.device)
        x[:end] = flat[:end]
        werr = self.worker_error.get(key)
        if werr is not None:
            x += werr
        wire, approx = compress(x.view(n, c))
        werr = x - approx.flatten()
        werr[end:] = 0  # padding: nothing of it is ever read
        self.worker_error[key] = werr
        mine = torch.empty_like(wire)
        comm.all_to_all(mine.flatten(), wire.flatten(), tag=f"{COMPRESSED}: 1-bit worker, {key}")
        y = decompress(mine).sum(0)
        serr = self.server_error.get(key)
        if serr is not None:
            y += serr
        block, approx_y = compress(y)
        self.server_error[key] = y - approx_y
        every = torch.empty(n, block.numel(), dtype=torch.uint8, device=flat.device)
        comm.all_gather(every.flatten(), block, tag=f"{COMPRESSED}: 1-bit server, {key}")
        flat[:end].copy_(decompress(every).flatten()[:end])
        if end < flat.numel():
            comm.all_reduce(flat[end:], tag=f"{COMPRESSED}: exact rest, {key}")
        replaced(comm, flat)
