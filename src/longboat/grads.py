"""Gradient arithmetic that every strategy shares: the global norm and clipping by it.

A strategy hands over the gradients this rank owns (``Strategy.local_gradients``) and the groups
over which those are disjoint pieces (``Strategy.norm_groups``: ZeRO's shard axis; none for
single and replicate, whose every rank holds the same full gradients). The squared norms are
summed over each of those groups, so data, tensor and pipeline sharding compose.
"""

from __future__ import annotations

from typing import Protocol

import torch

from longboat.comm.protocol import Comm

# [Note: long norms] torch's CPU 2-norm adds a tensor's squares in running sums, so its error
# grows with the tensor's length (the sum of squares: 1e-5 relative at half a million
# elements, 1e-4 at four million).
# A ZeRO shard is one flat tensor of many parameters, far longer than each of them, so its norm
# would stray from plain PyTorch's (a norm per parameter) by more than fp32 equivalence allows.
# A long tensor's norm is therefore taken per block of at most _BLOCK elements, then over the
# blocks (as GPU reductions, tree-shaped, already do); shorter tensors' norms stay exactly
# torch's, as plain PyTorch's clip_grad_norm_ takes them per parameter.
_BLOCK = 1 << 15


def _norm(g: torch.Tensor) -> torch.Tensor:
    """``g``'s 2-norm in fp32, its rounding that of a block ([Note: long norms])."""
    norm: torch.Tensor
    if g.numel() <= _BLOCK:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        return norm
    flat = g.reshape(-1)
    cut = flat.numel() - flat.numel() % _BLOCK
    blocks = torch.linalg.vector_norm(flat[:cut].view(-1, _BLOCK), dim=1, dtype=torch.float32)
    tail = torch.linalg.vector_norm(flat[cut:], dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.cat([blocks, tail.view(1)]))
    return norm


def _squares(grads: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    sq = torch.stack([_norm(g) for g in grads])
    return sq.pow(2).sum()


class HeldGradients(Protocol):
    """Gradients a strategy keeps out of memory (on disk): it knows their sum of squares, and
    scales them when it brings them back."""

    def gradient_squares(self) -> torch.Tensor: ...

    def scale_gradients(self, coef: torch.Tensor) -> None: ...


def global_norm(
    grads: list[torch.Tensor],
    groups: list[Comm],
    device: torch.device | str = "cpu",
    minus: list[torch.Tensor] | None = None,
    held: HeldGradients | None = None,
) -> torch.Tensor:
    """The 2-norm of all gradients of the model, the same value on every rank (fp32). A rank
    without gradients contributes zero, on ``device`` (the data plane's). ``minus``: parts of
    ``grads`` another rank counts, taken out of this rank's sum; ``held``: this rank's
    gradients kept out of memory, counted too."""
    total = _squares(grads, device)
    if held is not None:
        total = total + held.gradient_squares().to(total.device)
    if minus:
        total = (total - _squares(minus, device)).clamp(min=0.0)
    for comm in groups:
        comm.all_reduce(total)
    return total.sqrt()


def clip_by_global_norm_(
    grads: list[torch.Tensor],
    max_norm: float,
    groups: list[Comm],
    device: torch.device | str = "cpu",
    not_counted: list[torch.Tensor] | None = None,
    held: HeldGradients | None = None,
) -> torch.Tensor:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``; return the norm
    before clipping. Same rule as ``torch.nn.utils.clip_grad_norm_``. ``not_counted``: copies
    another rank counts, each one of ``grads`` (same storage and offset) or a view inside one
    (a parameter's share of a flat shard); they are scaled but left out of the norm."""
    whole = {(g.data_ptr(), g.numel()) for g in grads}
    skip = {(t.data_ptr(), t.numel()) for t in not_counted or []}
    counted = [g for g in grads if (g.data_ptr(), g.numel()) not in skip]
    inside = [t for t in not_counted or [] if (t.data_ptr(), t.numel()) not in whole]
    norm = global_norm(counted, groups, device, minus=inside, held=held)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    if held is not None:
        held.scale_gradients(coef)
    return norm
