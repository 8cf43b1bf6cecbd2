"""Buffers (BatchNorm's running statistics, counters) kept equal across data-parallel ranks.

[Note: buffers] Every data-parallel strategy treats buffers as DDP's ``broadcast_buffers`` does:
rank 0's buffers are the ones that count, and a forward that is not a training forward
communicates nothing. A *training forward* is one with the model in training mode and gradients
enabled; a forward under ``torch.no_grad()`` or in ``eval()`` mode is not, so one rank may
evaluate alone without a collective it would wait for forever.

DDP broadcasts rank 0's buffers *before* each training forward; longboat does it when that
forward's backward is over (the strategy's ``after_backward``). Each forward starts from the same
buffers either way (nothing between two forwards changes a buffer on one rank only: optimizer
steps leave buffers alone and checkpoints load the same values everywhere), but broadcasting
after the backward also leaves every rank's buffers equal once training stops, so every rank's
``state_dict()`` is the same and an evaluation on any rank sees rank 0's running statistics.
Not right after the forward: autograd saved the buffers the forward used (BatchNorm's running
statistics among them), and overwriting them before backward is an in-place modification that
backward refuses. In plain PyTorch terms: after a training forward and its backward on every
rank, each rank's buffers are what rank 0's forward left.

While ranks have joined ([Note: joining] in ``join.py``), a rank without a batch ran no forward
and takes part in the broadcast all the same (``shadow``), and the source is the lowest rank
that had a batch: rank 0's buffers count as long as rank 0 has batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from longboat.comm.protocol import Comm


class BufferSync:
    """Broadcasts rank 0's buffers after the backward of every training forward of ``model``
    ([Note: buffers]), one collective per dtype and device."""

    def __init__(self, model: nn.Module, comm: Comm) -> None:
        self.comm = comm
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in dict.fromkeys(model.buffers()):  # a shared buffer once
            groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = list(groups.values())
        self.dirty = False  # a training forward ran since the last sync
        self.source = 0  # the group rank whose buffers count
        self._hook: RemovableHandle | None = None
        if self.groups and comm.world_size > 1:
            self._hook = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, _args: Any, _out: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.dirty = True

    def after_backward(self) -> None:
        """Called by the strategy once a backward is over: sync if a training forward ran."""
        if self.dirty:
            self.dirty = False
            self.sync()

    def shadow(self) -> None:
        """This rank has no batch, the others ran a training forward: sync after the backward
        all the same ([Note: joining] in ``join.py``)."""
        self.dirty = True

    @torch.no_grad()
    def sync(self) -> None:
        """Give every rank the source's (rank 0's) buffers now (collective)."""
        src = self.source
        for bufs in self.groups:
            if len(bufs) == 1:
                self.comm.broadcast(bufs[0], src=src)
                continue
            flat = torch.cat([b.reshape(-1) for b in bufs])
            self.comm.broadcast(flat, src=src)
            offset = 0
            for b in bufs:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
