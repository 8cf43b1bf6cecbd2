"""Gradient arithmetic that every strategy shares: the global norm and clipping by it.

A strategy hands over the gradients this rank owns (``Strategy.local_gradients``). When they are
disjoint shards (ZeRO), the squared norms are summed across ranks; when every rank holds the same
full gradients (single, replicate), the local norm already is the global one.
"""

from __future__ import annotations

import torch

from longboat.comm.collectives import Collectives


def global_norm(grads: list[torch.Tensor], comm: Collectives, sharded: bool) -> torch.Tensor:
    """The 2-norm of all gradients of the model, the same value on every rank (fp32)."""
    if grads:
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        total = sq.pow(2).sum()
    else:
        total = torch.zeros((), dtype=torch.float32)
    if sharded:
        comm.all_reduce(total)
    return total.sqrt()


def clip_by_global_norm_(grads: list[torch.Tensor], max_norm: float, comm: Collectives,
                         sharded: bool) -> torch.Tensor:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``; return the norm
    before clipping. Same rule as ``torch.nn.utils.clip_grad_norm_``."""
    norm = global_norm(grads, comm, sharded)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
