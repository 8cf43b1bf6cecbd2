"""Replicated data parallelism: every rank holds the whole model; gradients are averaged.

Gradients accumulate in ``p.grad`` as in plain PyTorch until the accumulation boundary. In the
boundary's backward, per-parameter post-accumulate hooks copy each (accumulated) gradient into a
flat bucket (see :mod:`longboat.comm.buckets`); when a bucket's last gradient arrives its
all-reduce starts at once, so communication overlaps the rest of backward.

Buckets are launched strictly in index order on every rank ([Note: launch order] in
``comm/order.py``); those still incomplete when the boundary's backward returns go then. A
parameter whose hook did not fire in the boundary's backward was either used on an earlier
micro-batch of the step (its ``p.grad`` holds what it accumulated, and that is what goes into
the bucket) or not at all on this rank (zeros, and its usage flag stays 0: [Note: usage flags]
in ``comm/buckets.py``). After the all-reduce, a parameter that no rank used gets
``grad = None``, so the optimizer does not move it.

[Note: optimizer overlap] With ``replicate.overlap_optimizer``, unless the engine already waited
for every gradient (to clip, or to check for overflow), the optimizer runs bucket by bucket: as
soon as bucket k's all-reduce is done, it steps the parameters of bucket k while later buckets
are still on the wire. This uses the fact that torch's per-parameter optimizers skip parameters
whose ``grad`` is None, so showing an element-wise optimizer (``optim.is_elementwise``) one
bucket's gradients at a time gives exactly the update of one full step. It is not used when the
optimizer has step hooks (``register_step_pre_hook``/``post_hook``, its own or global ones), which
must fire once per step: then, as for any other optimizer, it steps once after every bucket
arrived.

[Note: communication dtype] With ``precision.communication_data_type`` different from a bucket's
gradient dtype (e.g. bf16 for fp32 gradients), the bucket's buffer is allocated in that dtype:
gradients are cast into it, all-reduced (half the bytes for bf16/fp16) and copied back, in one
flat copy per bucket, into an fp32 buffer that ``p.grad`` are views of. Without it the fp32 path
is unchanged: ``p.grad`` are views into the communicated bucket itself.

With ``compression.method`` set, once its warm-up is over each bucket is reduced by the
compressor instead of one all-reduce ([Note: compressed reduction] in
``comm/compression/protocol.py``): synchronously, when the bucket is launched, its usage flags
exact.

An optimizer that reduces itself ([Note: self-reducing optimizer] in ``optim/self_reducing.py``,
1-bit Adam after its warm-up) is handed the data-parallel doorway at setup; for each step it
asks for local gradients, no bucket is filled or launched: ``p.grad`` stays this rank's own
(None where this rank did not use the parameter) and the optimizer steps once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from longboat.comm import compression
from longboat.comm.buckets import Bucket, BucketPlan, plan_buckets
from longboat.comm.order import InOrder
from longboat.comm.protocol import Comm
from longboat.mesh import Axis
from longboat.observe.memory import optimizer_state_tensors
from longboat.optim.checks import has_step_hooks, is_elementwise
from longboat.optim.self_reducing import ReducesItself
from longboat.pieces import PieceSource, RankState, members
from longboat.strategies.base import StrategyContext, StrategyDefaults, full_gradient
from longboat.strategies.buffers import BufferSync
from longboat.strategies.whole_state import (
    WholeModel,
    load_whole_state,
    whole_model_state,
    whole_state,
)
from longboat.topology import Topology
from longboat.world import World

_MIB = 1024 * 1024


class Replicate(WholeModel, StrategyDefaults):
    """DDP-style replication with bucketed all-reduce overlapped with backward."""

    name = "replicate"
    can_shadow = True

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.section
        self.comm = ctx.topology.data("dp")  # replicas: the data-parallel axis
        self.plan: BucketPlan | None = None
        self.params: list[nn.Parameter] = []
        self._hooks: list[RemovableHandle] = []
        self._buffers: BufferSync | None = None
        self._sync = False
        self._order = InOrder(0, self._launch)  # [Note: launch order]
        self._arrived: list[set[int]] = []
        # Per bucket: where averaged gradients land when the bucket travels in another dtype
        # (see [Note: communication dtype]); None when p.grad are views into the bucket.
        self._landing: list[torch.Tensor | None] = []
        # Per bucket, after its all-reduce: which of its parameters some rank used.
        self._used: list[list[bool]] = []
        self.overlapped_steps = 0  # steps taken bucket by bucket ([Note: optimizer overlap])
        self._overlap = ctx.section.overlap_optimizer if ctx.section is not None else True
        self.compressor = compression.build(ctx.compression)
        # An optimizer that reduces itself, and whether it does in this step.
        self._reducer: ReducesItself | None = None
        self._local = False

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        cfg = self.cfg
        all_params = list(model.parameters())
        self.params = [p for p in dict.fromkeys(all_params) if p.requires_grad]
        # Every rank starts from rank 0's weights, whatever its own initialisation did.
        with torch.no_grad():
            for t in [*all_params, *model.buffers()]:
                self.comm.broadcast(t.data, src=0)
        self._buffers = BufferSync(model, self.comm)
        if isinstance(optimizer, ReducesItself):
            optimizer.longboat_bind(self.comm)
            self._reducer = optimizer
        self.plan = plan_buckets(
            all_params, int(cfg.bucket_mb * _MIB), int(cfg.first_bucket_mb * _MIB)
        )
        wire = self.ctx.wire_dtype
        for b in self.plan.buckets:
            if wire is not None and b.dtype.is_floating_point and b.dtype != wire:
                self._landing.append(torch.zeros(b.numel, dtype=b.dtype, device=b.device))
                b.dtype = wire  # the buffer (what travels) is allocated in this dtype
            else:
                self._landing.append(None)
            b.allocate()
        self._arrived = [set() for _ in self.plan.buckets]
        self._order = InOrder(len(self.plan.buckets), self._launch)
        self._used = [[False] * len(b.params) for b in self.plan.buckets]
        for p in self.params:
            # torch's register_post_accumulate_grad_hook is unannotated
            hook = p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            self._hooks.append(hook)
        return model

    def replica_ranks(self) -> int:
        """Every rank holds a whole replica."""
        return 1

    def replica_axis(self) -> Axis:
        return "dp"

    def replica_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [*model.parameters(), *model.buffers()]

    def keep_steps_whole(self) -> None:
        """Step the optimizer only once every bucket arrived (no [Note: optimizer overlap]):
        in-job recovery redoes a step whose reduction failed, which is exact only if no
        parameter moved in it."""
        self._overlap = False

    def regroup(self, topology: Topology, world: World) -> None:
        """Go on over ``topology``'s data-parallel axis after in-job recovery ([Note: in-job
        recovery] in ``longboat/recovery/__init__.py``): every replica's state stays as it is;
        the failed step's gradients and the reductions in flight on the old group are dropped."""
        self.ctx = dataclasses.replace(self.ctx, world=world, topology=topology)
        self.comm = topology.data("dp")
        assert self._buffers is not None
        self._buffers.comm = self.comm
        for b in self._buckets:
            b.handle = None
        for s in self._arrived:
            s.clear()
        self._order.reset()
        self._sync = False

    # -- the step ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        pass

    def before_backward(self, sync: bool) -> None:
        self._sync = sync
        # Decided once per step, alike on every rank (the optimizer's step count).
        self._local = self._reducer is not None and self._reducer.longboat_reduces_gradients()
        if sync:
            self._order.reset()
            for s in self._arrived:
                s.clear()
            for b in self._buckets:
                b.handle = None

    @property
    def _buckets(self) -> list[Bucket]:
        assert self.plan is not None, "setup() first"
        return self.plan.buckets

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync or self._local or p.grad is None:
            return  # between boundaries gradients accumulate in p.grad, as in plain PyTorch
        bucket, i = self.plan.locate(p)  # type: ignore[union-attr]
        bucket.view_of(i).copy_(p.grad)
        self._arrived[bucket.index].add(i)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        if self._local:
            return  # the optimizer reduces ([Note: self-reducing optimizer])
        self._order.advance(lambda i: len(self._arrived[i]) == len(self._buckets[i].params), force)

    def _launch(self, index: int) -> None:
        b = self._buckets[index]
        arrived = self._arrived[index]
        assert b.buffer is not None
        used = []
        for i, p in enumerate(b.params):
            if i in arrived:
                used.append(True)
            elif p.grad is not None:  # used on an earlier micro-batch of this step only
                b.view_of(i).copy_(p.grad)
                used.append(True)
            else:  # not used on this rank in this step
                b.view_of(i).zero_()
                used.append(False)
        _write_flags(b.flags(), used)
        self._used[index] = used  # this rank's; the all-reduce tells about the others
        # An average: gloo has no AVG, the doorway divides first (and keeps magnitudes small).
        # The flags are divided too: what matters is only whether their sum is above zero.
        c = self.compressor
        if c is not None and c.compressing and self.comm.world_size > 1:
            # [Note: compressed reduction]: the average as a compressed sum of divided buffers
            b.buffer.div_(self.comm.world_size)
            spans = [(off, p.shape) for off, p in zip(b.offsets, b.params, strict=True)]
            c.all_reduce(f"bucket {index}", b.buffer, spans, self.comm)
            b.handle = compression.Done()
            return
        # [Note: spread reductions] in topology.py: bucket k's doorway.
        reducer = self.ctx.topology.reducer("dp", index)
        b.handle = reducer.all_reduce(b.buffer, op="avg", async_op=True)

    def after_backward(self) -> None:
        if self._sync:  # buckets this backward did not complete go now, before anything else
            self._launch_ready(force=True)
        assert self._buffers is not None
        self._buffers.after_backward()

    def shadow(self) -> None:
        # [Note: joining] in join.py: after_backward launches every bucket, this rank's
        # gradients zeros (or what earlier micro-batches of the step accumulated) and its usage
        # flags 0; the buffers' broadcast happens as after the others' training forward.
        assert self._buffers is not None
        self._buffers.shadow()

    def buffers_from(self, rank: int) -> None:
        assert self._buffers is not None
        self._buffers.source = rank

    def finish_gradients(self) -> None:
        # Only launch here; waiting is deferred so the optimizer can overlap the tail of the
        # communication (see [Note: optimizer overlap]).
        self._launch_ready(force=True)
        self._sync = False

    def _wait(self, b: Bucket) -> None:
        if b.handle is None:
            return
        b.handle.wait()  # type: ignore[attr-defined]
        b.handle = None
        landing = self._landing[b.index]
        if landing is not None:
            assert b.buffer is not None
            landing.copy_(b.buffer[: b.numel])
        if self.comm.active:  # else (a world of one, the planner's meta run) this rank's own
            self._used[b.index] = [f > 0 for f in b.flags().tolist()]
        self._show_grads(b)

    def _show_grads(self, b: Bucket) -> None:
        """The averaged gradient becomes ``p.grad``, as a view into the bucket (or into its
        landing buffer, see [Note: communication dtype]); None for a parameter no rank used."""
        for i, p in enumerate(b.params):
            p.grad = self._grad_view(b, i) if self._used[b.index][i] else None

    def _grad_view(self, b: Bucket, i: int) -> torch.Tensor:
        """Where parameter ``i`` of ``b`` finds its averaged gradient."""
        landing = self._landing[b.index]
        if landing is None:
            return b.view_of(i)
        p = b.params[i]
        return landing[b.offsets[i] : b.offsets[i] + p.numel()].view_as(p)

    def wait_gradients(self) -> None:
        for b in self._buckets:
            self._wait(b)

    def hooked_modules(self) -> list[nn.Module]:
        return []  # no forward hooks

    def norm_groups(self) -> list[Comm]:
        return []  # identical on every rank after the all-reduce: a local norm is global

    def local_gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        return full_gradient(param)

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pending = any(b.handle is not None for b in self._buckets)
        if not (
            pending
            # Alone, nothing is on the wire to overlap, and stepping bucket by bucket costs a
            # launch of every optimizer kernel per bucket (1.33x a plain bf16 step on an H100,
            # benchmarks/results/gpu/step_time.json at 567ea30)
            and self.comm.world_size > 1
            and self._overlap
            and is_elementwise(optimizer)
            and not has_step_hooks(optimizer)
        ):
            self.wait_gradients()
            optimizer.step()
            self._stepped()
            return
        self.overlapped_steps += 1
        for p in self.params:
            p.grad = None  # hide local, unreduced gradients from the optimizer
        for b in self._buckets:
            self._wait(b)  # sets this bucket's averaged gradients
            optimizer.step()  # steps only parameters with a gradient: this bucket's
            for p in b.params:
                p.grad = None
        for b in self._buckets:  # leave every averaged gradient visible after the step
            self._show_grads(b)
        self._stepped()

    def _stepped(self) -> None:
        if self.compressor is not None:
            self.compressor.step_done()  # the warm-up counts optimizer steps

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """[Note: memory formulas]: the whole model, its gradients and its optimizer state."""
        return whole_model_state(a, k)

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        # The buckets are where averaged gradients live (p.grad are views into them).
        return {
            "parameters": list(self.params),
            "gradients": [b.buffer for b in self._buckets if b.buffer is not None]
            + [p.grad for p in self.params if p.grad is not None],
            "optimizer_state": optimizer_state_tensors(optimizer),
        }

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        # Every rank of the axis holds the same state: each tensor is written once, by one rank.
        return whole_state(model, optimizer, members(self.comm))

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        load_whole_state(model, optimizer, source)  # every rank reads the same: replicas agree

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._buffers is not None:
            self._buffers.close()

    def leave(self) -> None:
        self.close()  # no collective in it


def _write_flags(flags: torch.Tensor, used: list[bool]) -> None:
    """``flags[i] = used[i]`` by fills on the flags' own device. A copy from a host list would
    be a copy from pageable memory, which on a GPU waits for the stream to drain: once per
    bucket in the middle of the backward (11% of a GPT-2-small step at a world of one on an
    H200, benchmarks/results/gpu/step_time.json). Unused parameters come in runs, if at all."""
    flags.fill_(1)
    i, n = 0, len(used)
    while i < n:
        if used[i]:
            i += 1
            continue
        j = i
        while j < n and not used[j]:
            j += 1
        flags[i:j].zero_()
        i = j
