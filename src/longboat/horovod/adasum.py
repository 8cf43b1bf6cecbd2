"""Adasum: the adaptive summation of gradients (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), as Horovod's ``op=hvd.Adasum`` applies it.

[Note: Adasum] Two gradients combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add, equal ones average, and the sum of partly aligned ones loses the
part they share once. Ranks combine in a binary tree: ranks 2i and 2i+1, then those pairs' results
pairwise, and so on (recursive doubling), which needs a power-of-two number of ranks, as
Horovod's does. A zero gradient contributes nothing and leaves the other whole.
"""

from __future__ import annotations

import torch


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``adasum(a, b)`` for two gradients of one shape, in fp64 for the dot products."""
    dot = torch.sum(a.double() * b.double())
    na, nb = torch.sum(a.double() ** 2), torch.sum(b.double() ** 2)
    ca = 1 - dot / (2 * na) if na > 0 else torch.zeros((), dtype=torch.float64)
    cb = 1 - dot / (2 * nb) if nb > 0 else torch.zeros((), dtype=torch.float64)
    if na == 0:
        cb = torch.ones((), dtype=torch.float64)
    if nb == 0:
        ca = torch.ones((), dtype=torch.float64)
    return (ca * a.double() + cb * b.double()).to(a.dtype)


def tree(grads: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's gradient (in rank order) combined pairwise up a binary tree."""
    n = len(grads)
    if n & (n - 1):
        raise ValueError(f"Adasum combines a power-of-two number of ranks, got {n}")
    level = list(grads)
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


__all__ = ["pair", "tree"]
