"""Replicated data parallelism: every rank holds the whole model; gradients are averaged.

Gradients are copied into flat buckets (see :mod:`longboat.comm.buckets`) by per-parameter
post-accumulate hooks. When a bucket's last gradient arrives its all-reduce starts at once, so
communication overlaps the rest of backward. Between accumulation boundaries the hooks do
nothing and gradients accumulate locally, without any communication.

[Note: launch order] Buckets are launched strictly in index order on every rank: a bucket that
becomes ready before its predecessors waits for them. gloo and NCCL match collectives by their
order, so a different order on two ranks would pair different buckets (a hang or wrong sums).
Buckets still incomplete after backward (parameters unused in this forward) are launched in
order by :meth:`Replicate.finish_gradients`, contributing zeros for the unused parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from longboat.comm.buckets import Bucket, BucketPlan, plan_buckets
from longboat.strategies.base import StrategyContext

_MIB = 1024 * 1024


class Replicate:
    """DDP-style replication with bucketed all-reduce overlapped with backward."""

    name = "replicate"

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.comm = ctx.comm
        self.plan: BucketPlan | None = None
        self.params: list[nn.Parameter] = []
        self.buffers: list[torch.Tensor] = []
        self._hooks: list[RemovableHandle] = []
        self._sync = False
        self._next = 0  # index of the next bucket to launch (see [Note: launch order])
        self._arrived: list[set[int]] = []

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        cfg = self.ctx.config.replicate
        all_params = list(model.parameters())
        self.params = [p for p in all_params if p.requires_grad]
        self.buffers = list(model.buffers())
        # Every rank starts from rank 0's weights, whatever its own initialisation did.
        with torch.no_grad():
            for t in [*all_params, *model.buffers()]:
                self.comm.broadcast(t.data, src=0)
        self.plan = plan_buckets(
            all_params, int(cfg.bucket_mb * _MIB), int(cfg.first_bucket_mb * _MIB)
        )
        for b in self.plan.buckets:
            b.allocate()
        self._arrived = [set() for _ in self.plan.buckets]
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return model

    # -- the step ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        # Like DDP's broadcast_buffers: running statistics follow rank 0, so evaluation
        # is the same on every rank.
        for b in self.buffers:
            self.comm.broadcast(b, src=0)

    def before_backward(self, sync: bool) -> None:
        self._sync = sync
        if sync:
            self._next = 0
            for s in self._arrived:
                s.clear()
            for b in self._buckets:
                b.handle = None

    @property
    def _buckets(self) -> list[Bucket]:
        assert self.plan is not None, "setup() first"
        return self.plan.buckets

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync or p.grad is None:
            return
        bucket, i = self.plan.locate(p)  # type: ignore[union-attr]
        bucket.view_of(i).copy_(p.grad)
        self._arrived[bucket.index].add(i)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            missing = len(b.params) - len(self._arrived[b.index])
            if missing and not force:
                return
            if missing:
                for i in range(len(b.params)):
                    if i not in self._arrived[b.index]:
                        b.view_of(i).zero_()
            assert b.buffer is not None
            # gloo has no AVG: divide first, then sum (keeps magnitudes small as well).
            b.buffer.div_(self.comm.world_size)
            b.handle = self.comm.all_reduce(b.buffer, async_op=True)
            self._next += 1

    def finish_gradients(self) -> None:
        self._launch_ready(force=True)
        for b in self._buckets:
            assert b.handle is not None, "bucket not launched"
            b.handle.wait()  # type: ignore[attr-defined]
            b.handle = None
            for i, p in enumerate(b.params):
                # The averaged gradient becomes p.grad as a view into the bucket: no copy back.
                p.grad = b.view_of(i)
        self._sync = False

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # Gradients are identical on every rank after finish_gradients: a local norm is global.
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
