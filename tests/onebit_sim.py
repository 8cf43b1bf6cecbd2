"""A plain PyTorch simulation of N data-parallel ranks for optimizers that average their
momentum in 1 bit (tests/test_onebit_adam.py, tests/test_onebit_lamb.py). It imports nothing
from longboat.

Each rank's forward and backward run on that rank's samples, each rank's gradient kept apart
(the buffers rank 0's forward left count, as reference.py states); then the optimizer's rule,
given per parameter in the optimizer's order, updates the parameter from every rank's gradient
(zeros where a rank did not use it). A parameter no rank used is skipped, with no state.

:class:`SimAverage` is the 1-bit average as docs/compression.md states it: each rank adds its
worker residual to its padded ``m_r / n`` (n chunks of c elements, c a multiple of 8), sends each
chunk's signs (+1 for >= 0) times ``||chunk|| / sqrt(c)`` and keeps the rest as its residual;
server j sums the chunks j, adds its residual, sends the same compression of it and keeps the
rest. With one rank the average is the tensor itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import reference
import torch

#: (name, parameter, every rank's gradient, the parameter's state (empty at first), step index)
Rule = Callable[[str, torch.Tensor, list[torch.Tensor], dict[str, Any], int], None]


def one_bit(x: torch.Tensor) -> torch.Tensor:
    """Each row of x as its signs (+1 for >= 0) times ||row|| / sqrt(len(row))."""
    scale = x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return torch.where(x >= 0, 1.0, -1.0) * scale


class SimAverage:
    """The 1-bit average of every rank's tensor, residuals per (key, rank)."""

    def __init__(self) -> None:
        self.worker: dict[tuple[str, int], torch.Tensor] = {}
        self.server: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, key: str, parts: list[torch.Tensor]) -> torch.Tensor:
        n = len(parts)
        if n == 1:
            return parts[0].clone()
        numel = parts[0].numel()
        c = math.ceil(numel / (8 * n)) * 8
        sent = []
        for r, t in enumerate(parts):
            x = torch.zeros(n * c)
            x[:numel] = t.flatten() / n
            x += self.worker.get((key, r), torch.zeros(n * c))
            d = one_bit(x.view(n, c))
            err = x - d.flatten()
            err[numel:] = 0
            self.worker[(key, r)] = err
            sent.append(d)
        out = []
        for j in range(n):
            y = torch.stack([d[j] for d in sent]).sum(0)
            y += self.server.get((key, j), torch.zeros(c))
            d = one_bit(y)
            self.server[(key, j)] = y - d
            out.append(d)
        return torch.cat(out)[:numel].view_as(parts[0])


def simulate(
    recipe: reference.Recipe, data: Any, order: list[list[list[int]]], rule: Rule
) -> tuple[list[list[float]], dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Losses [step][rank], the state_dict and the optimizer state by parameter name, after
    ``order[step][rank]`` samples of ``data`` trained with ``rule``."""
    model, _, _ = recipe.build()
    named = list(model.named_parameters())
    state: dict[str, dict[str, Any]] = {}
    losses = []
    for step, micro in enumerate(order):
        before = {k: b.clone() for k, b in model.named_buffers()}
        first: dict[str, torch.Tensor] = {}
        grads: list[dict[str, torch.Tensor | None]] = []
        step_losses = []
        for r, ids in enumerate(micro):
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(before[k])
            model.zero_grad(set_to_none=True)
            _, *batch = data[list(ids)]
            loss = reference.forward_loss(model, batch)
            loss.backward()
            step_losses.append(float(loss.detach()))
            grads.append({k: None if p.grad is None else p.grad.clone() for k, p in named})
            if r == 0:
                first = {k: b.clone() for k, b in model.named_buffers()}
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(first[k])
        losses.append(step_losses)
        with torch.no_grad():
            for k, p in named:
                if all(g[k] is None for g in grads):
                    continue  # no rank used it: no update, no state
                mine = [g[k] if g[k] is not None else torch.zeros_like(p) for g in grads]
                rule(k, p, mine, state.setdefault(k, {}), step)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, state
