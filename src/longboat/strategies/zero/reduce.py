"""ZeRO's gradient reduction: each unit's flat gradient to this rank's shard, in unit order.

[Note: unused parameters] A parameter's gradient accumulates over every micro-batch of the step
in the unit's flat buffer, whichever micro-batches used it. Which parameters some rank used in the
step is decided once per step: each rank's usage is all-reduced (MAX, one small collective per
step, launched with the last reduce-scatters and awaited at the optimizer step). A parameter
used by some ranks only gets the average over all ranks (zeros from the others, as DDP gives); a
parameter that no rank used gets ``grad = None`` on its pieces, so the optimizer skips it as plain
PyTorch does.

[Note: compressed ZeRO] With ``compression.method`` set, once its warm-up is over a unit's
reduce-scatter becomes a compressed all-reduce of the unit's full (divided) gradient over the
shard group, after which each rank keeps its shard ([Note: compressed reduction] in
``comm/compression/protocol.py``). That trades ZeRO's reduce-scatter, ``(n-1)/n`` of the fp32
buffer per rank, for an all-reduce of a much smaller payload (PowerSGD's factors, 1-bit signs),
which error feedback needs: a residual is kept for the whole unit, not the shard. It is
synchronous, where the reduce-scatter overlapped the rest of backward. Stages 2-3 reduce every
micro-batch, so with gradient accumulation each micro-batch's gradient is compressed (stage 1
compresses the step's accumulated gradient once, as replicate does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longboat.comm import compression
from longboat.comm.order import InOrder
from longboat.config.errors import ConfigError
from longboat.strategies.base import StrategyContext
from longboat.strategies.zero.flat import FlatUnit
from longboat.strategies.zero.gather import UNIT_FIX
from longboat.strategies.zero.home import Home
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.topology import Topology


class Reduction:
    """The units' reductions over the shard group, launched strictly in unit order ([Note:
    launch order] in ``comm/order.py``), each landing where the units' home keeps gradient
    shards ([Note: homes] in ``homes.py``); once per step, the replicas' average ([Note:
    hybrid sharding] in ``strategy.py``) and the usage vote ([Note: unused parameters])."""

    def __init__(
        self,
        ctx: StrategyContext,
        policy: ZeroPolicy,
        units: list[FlatUnit],
        where: dict[int, tuple[FlatUnit, int]],
        home: Home,
        compressor: compression.Compressor | None,
        record: Callable[[tuple[str, int]], None],
    ) -> None:
        topo = ctx.topology
        self.topology = topo
        self.dp = topo.data("dp")
        self.comm = topo.data("dp_shard")
        self.replicas = topo.data("dp_replicate")
        self.control = topo.control("dp")
        self.policy = policy
        self.units = units
        self.where = where  # id(parameter): its unit and index there
        self.home = home
        self.record = record  # [Note: stage-3 shadow] in ``shadow.py``
        self.wire = ctx.wire_dtype
        self.compressor = compressor  # [Note: compressed ZeRO]
        # Stages 2-3 on one data-parallel rank: no reduction at all; gradients accumulate in
        # the shard, when the home keeps it in memory (on disk, the reduction, a copy, lands it
        # there).
        self.alone = policy.shard_grads and self.dp.world_size == 1 and home.grads_in_memory
        self.order = InOrder(len(units), self.launch)
        self.sync = False  # this backward ends the step's accumulation
        self._usage: torch.Tensor | None = None  # the step's usage, all-reduced (in flight)
        self._usage_handle: object | None = None
        self._replicas_due = False  # a step's shards still to be averaged across replicas

    def regroup(self, topology: Topology) -> None:
        """Reduce over ``topology``'s groups from now on; what was in flight on the old ones
        is dropped (in-job recovery redoes the step)."""
        self.topology = topology
        self.dp, self.comm = topology.data("dp"), topology.data("dp_shard")
        self.replicas, self.control = topology.data("dp_replicate"), topology.control("dp")
        self.alone = (
            self.policy.shard_grads and self.dp.world_size == 1 and self.home.grads_in_memory
        )
        self.order.reset()
        self.sync = False
        self._usage = self._usage_handle = None
        self._replicas_due = False

    # -- during backward -----------------------------------------------------------------------

    def before_backward(self, sync: bool) -> None:
        self.sync = sync
        self.order.reset()
        for u in self.units:
            u.arrived.clear()
            u.backward_done = False

    def after_backward(self) -> None:
        if self.policy.reduces_now(self.sync):
            # Units some parameter of which this backward did not reach (unused on this
            # micro-batch, or on this rank) are launched now, in order ([Note: launch order]),
            # before any other collective: ranks that completed them during backward did so.
            self.order.advance(self.unit_done, force=True)

    def unit_done(self, index: int) -> bool:
        """Whether unit ``index``'s gradients of this backward are all in: for stage 3, on an
        event every rank sees alike ([Note: stage-3 order] in ``strategy.py``)."""
        u = self.units[index]
        return u.backward_done if self.policy.shard_params else u.complete

    def on_grad(self, p: torch.Tensor) -> None:
        """A parameter's gradient is in: into its unit's flat buffer, and the units that are
        complete launched."""
        u, i = self.where[id(p)]
        assert p.grad is not None
        if p.grad.shape != u.shapes[i]:  # read while its unit was not gathered
            raise ConfigError(
                f"zero-3: a parameter of {u.tag} ({type(u.module).__name__}) was used while its "
                "unit was not gathered: its module's forward did not run, and another module "
                f"read its parameters directly ([Note: units run forward]); {UNIT_FIX}"
            )
        flat_grad = u.flat_grad
        if flat_grad is None:  # stages 2-3: a transient buffer per backward
            # On one data-parallel rank the shard is the whole unit: gradients accumulate in
            # it directly, with nothing to reduce (no more memory than a single process).
            if self.alone:
                assert u.grad_shard is not None  # stages 2-3 keep a gradient shard
                flat_grad = u.grad_shard
            else:
                # In the gathered dtype: the gradients of its parameters (gather.py's [Note:
                # parameter dtype]); they land in the shard's own.
                flat_grad = self.home.buffer(u.padded, u.gathered_dtype, u.device).zero_()
            u.flat_grad = flat_grad
        u.view(flat_grad, i).add_(p.grad)
        # The unit holds the buffer: a name here would keep it alive past its landing in
        # ``reap`` below, until this hook returns.
        del flat_grad
        p.grad = None  # the flat buffer holds it now; free the full-size gradient
        u.arrived.add(i)
        u.used.add(i)
        if self.order.launched(u.index):  # its reduction is on the wire without this gradient
            raise RuntimeError(
                f"zero: a gradient of {u.tag} arrived after its reduction started (stage "
                f"{self.policy.stage}); autograd ran its accumulation after the unit's backward "
                "ended. Please report this with the model; stage 2 does not depend on that order"
            )
        if not self.policy.shard_params and self.policy.reduces_now(self.sync):
            self.order.advance(self.unit_done)
        self.reap()

    def reap(self) -> None:
        """Land the reductions that are over already, freeing their full-size buffers while
        backward still runs (stages 2-3)."""
        if not self.policy.shard_grads:
            return
        for u in self.units[: self.order.next]:
            if u.reduced is not None and _completed(u.reduce_handle):
                self.home.land(u)

    # -- one unit ------------------------------------------------------------------------------

    def launch(self, index: int) -> None:
        """Launch unit ``index``'s reduction (what the in-order launcher calls)."""
        u = self.units[index]
        if self.alone:
            u.flat_grad = None  # it was the gradient shard itself: nothing to reduce
            return
        if u.flat_grad is None:  # no parameter of this unit was used
            u.flat_grad = self.home.buffer(u.padded, u.gathered_dtype, u.device).zero_()
        # The average over every data-parallel rank: the shard group sums now, the replicas
        # at the boundary (gloo has no AVG: divide first).
        u.flat_grad.div_(self.dp.world_size)
        c = self.compressor
        if c is not None and c.compressing and self.comm.world_size > 1:
            self._compressed(u, c)
        else:
            self._scatter(u)

    def _compressed(self, u: FlatUnit, c: compression.Compressor) -> None:
        """[Note: compressed ZeRO]: an all-reduce of the whole unit, of which the shard is kept."""
        assert u.flat_grad is not None
        spans = list(zip(u.offsets, u.shapes, strict=True))
        c.all_reduce(f"unit {u.index}", u.flat_grad, spans, self.comm)
        u.reduced = u.flat_grad[u.lo : u.hi].clone()
        u.shard_empty = False
        self.record(("reduce", u.index))
        u.reduce_handle = compression.Done()

    def _scatter(self, u: FlatUnit) -> None:
        """The unit's reduce-scatter, in flight until the home lands it."""
        assert u.flat_grad is not None
        # precision.reduce_dtype (communication_data_type): gradients travel (and are summed)
        # in that dtype, else in the dtype the unit computes in (param_dtype's under [Note:
        # parameter dtype], as FSDP2 reduces in param_dtype when reduce_dtype is None; stage 1
        # accumulates them in fp32 and casts here), and land back in the fp32 shard when the
        # home lands them.
        # One rank sends nothing: stage 1's fp32 sum stays as it is, as stage 2's does.
        alone = self.comm.world_size == 1
        wire = self.wire or (u.flat_grad.dtype if alone else u.gathered_dtype)
        send = u.flat_grad if wire == u.flat_grad.dtype else u.flat_grad.to(wire)
        if (
            self.policy.shard_grads
            and u.shard_empty
            and send.dtype == u.dtype
            and self.home.grads_in_memory  # on disk: the shard has no memory to land in
        ):
            # [Note: reduce in place] The shard holds nothing yet this step: the reduction
            # lands in it directly, and no shard-size buffer per unit in flight is needed
            # (with every unit in flight at the end of a backward, 2 bytes per parameter in fp32
            # at two ranks, the whole difference to DeepSpeed's peak in zero_vs_peers).
            assert u.grad_shard is not None  # shard_grads: the shard is kept
            reduced = u.grad_shard
        else:
            reduced = self.home.buffer(u.shard_numel, send.dtype, u.device)
        u.reduced = reduced
        u.shard_empty = False
        self.record(("reduce", u.index))
        # Stages 2-3 drop the full-size buffer once the shard landed, and a cast copy is
        # nobody's: the doorway may reduce in it ([Note: gloo reduce-scatter]).
        scratch = self.policy.shard_grads or send is not u.flat_grad
        u.reduce_handle = self.topology.reducer("dp_shard", u.index).reduce_scatter(
            reduced, send, async_op=True, tag=u.tag, scratch=scratch
        )
        self.home.launched(self.units, u.index)

    # -- the step's end ------------------------------------------------------------------------

    def finish(self) -> None:
        """Every unit launched; the usage vote of [Note: unused parameters] on its way."""
        self.order.advance(self.unit_done, force=True)
        self.sync = False
        self._replicas_due = True
        if self.control.world_size > 1 and self.units:  # a small CPU vector: control plane
            used = [float(i in u.used) for u in self.units for i in range(len(u.params))]
            self._usage = torch.tensor(used, dtype=torch.float32)
            self._usage_handle = self.control.all_reduce(self._usage, op="max", async_op=True)

    def wait(self) -> None:
        """Every reduction landed; after a step's last, the replicas' average."""
        for u in self.units:
            if u.reduced is not None:
                self.home.land(u)
        if self._replicas_due:  # once per step, after the last micro-batch's reductions
            self._replicas_due = False
            for u in self.units:
                self.replicas.all_reduce(u.grad_view())

    def used_by_any_rank(self) -> list[set[int]]:
        """Per unit, the parameters some rank used in this step ([Note: unused parameters])."""
        usage, handle = self._usage, self._usage_handle
        self._usage = self._usage_handle = None
        if usage is None or not self.control.active:  # one rank, or the planner's meta run
            return [set(u.used) for u in self.units]
        handle.wait()  # type: ignore[union-attr]
        flags = iter(usage.tolist())
        return [{i for i in range(len(u.params)) if next(flags) > 0} for u in self.units]


def _completed(handle: object) -> bool:
    done = getattr(handle, "is_completed", None)
    return bool(done()) if done is not None else False
