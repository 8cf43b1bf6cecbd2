"""ZeRO: sharded data parallelism, stages 1, 2 and 3, built from flat units (see
:mod:`longboat.strategies.zero.flat`).

- stage 1: optimizer state sharded. Gradients accumulate in a full flat buffer; at the boundary
  it is reduce-scattered, each rank steps its shard, and the shards are all-gathered back.
- stage 2: gradients sharded too. A unit's gradients are reduce-scattered as soon as its last
  gradient arrives during backward (every micro-batch), and only the shard is kept.
- stage 3: parameters sharded too. A unit's module gathers its parameters just before its
  forward and again before its backward (the next unit's gather prefetched), and frees them
  right after each.

The optimizer the user built is re-targeted at this rank's pieces of the parameters, one per
parameter its shards overlap ([Note: shard pieces] in ``flat.py``), so any element-wise
optimizer (``optim.is_elementwise``: SGD, Adam, AdamW, ...) works unchanged; gradients,
per-element and per-parameter states and weight decay are exactly those of the unsharded run.

[Note: unused parameters] A parameter's gradient accumulates over every micro-batch of the step
in the unit's flat buffer, whichever micro-batches used it. Which parameters some rank used in the
step is decided once per step: each rank's usage is all-reduced (MAX, one small collective per
step, launched with the last reduce-scatters and awaited at the optimizer step). A parameter
used by some ranks only gets the average over all ranks (zeros from the others, as DDP gives); a
parameter that no rank used gets ``grad = None`` on its pieces, so the optimizer skips it as plain
PyTorch does.

[Note: hybrid sharding] On a mesh with ``dp_replicate`` x ``dp_shard`` data-parallel ranks
(FSDP2's HSDP, the idea of DeepSpeed ZeRO++'s hpZ), units are sharded over the ``dp_shard`` group
only and the shard groups are replicas of each other: gathers and reduce-scatters stay within a
shard group (inside a node, where bandwidth is), and once per step each rank's reduced gradient
shard is all-reduced with the same shard of the other replicas. Gradients are divided by the whole
``dp`` size before the reduce-scatter, so the result is the average over every data-parallel
rank. Without ``dp_replicate`` the shard group is the whole ``dp`` axis and the replica group one
rank: plain ZeRO.

Units launch their reduce-scatters strictly in unit order on every rank ([Note: launch order]
in ``comm/order.py``). What each stage shards and when it communicates is a
:class:`~longboat.strategies.zero.policy.ZeroPolicy`; stage 3's gathers live in
:mod:`longboat.strategies.zero.gather`.

[Note: stage-3 order] Stage 3 mixes two kinds of collective during backward: the gathers of the
units still to run and the reduce-scatters of those done. Collectives are matched by order, so
both must be issued at events every rank sees alike, never at "this rank has all of the unit's
gradients", which differs between ranks when a parameter is used on some ranks only (a routed
expert inside a unit). Gathers happen when a unit's outputs receive their gradients (before its
backward); a unit's backward is over when the gradients of its inputs exist, which an identity
on the inputs reports (``zero_gather._PostBackward``, as FSDP2's post-backward hook); its
reduce-scatter is launched then, or, for a unit whose inputs need no gradient (the first, the
root), once the whole backward returned. Each rank must run the same units in the same order: a
unit whose module runs on some ranks only (a routed expert as a unit of its own) cannot be
gathered by the others, and the desync check names it (each gather and reduce-scatter carries its
unit's tag); put such modules inside a unit that always runs.

[Note: stage-3 shadow] A rank without a batch for a micro-batch ([Note: joining] in ``join.py``)
must still take part in stage 3's gathers, forward and backward, and in the reduce-scatters
between them, in the order the others issue them. Two ways were open: run a forward and backward
on no data (an empty or remembered batch), or replay the collectives without compute. The
replay is the simpler correct one: an empty batch breaks layers such as BatchNorm, a remembered
one costs a whole forward and backward, and either would mark parameters used and move the
joined rank's buffers. So every real micro-batch records, in issue order, the gathers and
reduce-scatters it put on the shard group (from ``before_forward`` to the reductions
``after_backward`` launches), and a shadow replays its rank's last record: each gather
synchronously (gathered, then freed at once), each reduce-scatter through the in-order launcher
with the zeros of a unit that received no gradient. That is exactly the others' sequence because
those events are the ones every rank sees alike ([Note: stage-3 order]) and every rank runs the
same units in the same order on each micro-batch; a model whose units change from one
micro-batch to the next would replay the wrong ones, and the desync check names the units
then. A rank that runs out before its first micro-batch has nothing to replay and says so.

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

import contextlib
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from longboat.comm import compression
from longboat.comm.order import InOrder
from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.observe.memory import (
    expected_bytes,
    optimizer_state_bytes_per_param,
    optimizer_state_tensors,
)
from longboat.optim import (
    describe_elementwise,
    has_step_hooks,
    is_elementwise,
    why_not_elementwise,
)
from longboat.pieces import PieceSource, RankState
from longboat.strategies.base import StrategyContext
from longboat.strategies.buffers import BufferSync
from longboat.strategies.zero import state as zero_state
from longboat.strategies.zero.flat import FlatUnit, UnitState
from longboat.strategies.zero.gather import UNIT_FIX, Gathering, Removable
from longboat.strategies.zero.init import DeferredInit
from longboat.strategies.zero.offload import StateSwap, UnitStream, check_room
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.strategies.zero.shard_swap import ShardSwap
from longboat.strategies.zero.storage import free_storage
from longboat.strategies.zero.units import bucket_units, module_units


class Zero:
    """ZeRO stages 1-3 behind the :class:`~longboat.strategies.base.Strategy` protocol."""

    name = "zero"

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        topo = ctx.topology
        # [Note: hybrid sharding]: shards over dp_shard, replicas across dp_replicate; the
        # whole dp axis sees different data and shares buffers and usage.
        self.dp = topo.data("dp")
        self.comm = topo.data("dp_shard")
        self.replicas = topo.data("dp_replicate")
        self.control = topo.control("dp")
        self.cfg = ctx.section
        self.policy = ZeroPolicy.of(self.cfg.stage)
        self.name = f"zero-{self.policy.stage}"
        self.units: list[FlatUnit] = []
        self.where: dict[int, tuple[FlatUnit, int]] = {}
        self._hooks: list[Removable] = []
        self._sync = False
        self._order = InOrder(0, self._reduce)
        self._gathering: Gathering | None = None  # stage 3
        self._buffers: BufferSync | None = None
        self._usage: torch.Tensor | None = None  # the step's usage, all-reduced (in flight)
        self._usage_handle: object | None = None
        self._reduce_replicas = False  # a step's shards still to be averaged across replicas
        self._wire = ctx.wire_dtype
        # [Note: parameter offload]: stage 3's shards on disk between uses
        self._params_on_disk = self.cfg.offload_param.device == "disk"
        # Stages 2-3 on one data-parallel rank: no reduction at all (see _on_grad); with the
        # gradient shard on disk, the reduction (a copy) still lands it there.
        self._alone = (
            self.policy.shard_grads and self.dp.world_size == 1 and not self._params_on_disk
        )
        self._swap: StateSwap | None = None  # [Note: optimizer state offload]
        self._shards: ShardSwap | None = None
        self._stream: UnitStream | None = None  # steps units with their offloaded parts
        # [Note: stage-3 shadow]: this micro-batch's gathers and reductions, in issue order,
        # and the last real micro-batch's, which a shadow replays
        self._schedule: list[tuple[str, int]] = []
        self._replay: list[tuple[str, int]] | None = None
        self.compressor = compression.build(ctx.compression)  # [Note: compressed ZeRO]

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if not is_elementwise(optimizer):
            raise ConfigError(
                f"strategy 'zero' steps the optimizer on pieces of flat shards, which is exact "
                f"only for element-wise optimizers: {describe_elementwise()}; "
                f"{type(optimizer).__name__} is not one of them ({why_not_elementwise(optimizer)})."
                " Use strategy 'replicate', or one of those optimizers"
            )
        if optimizer.state:
            raise ConfigError(
                "strategy 'zero' needs a fresh optimizer (it re-targets the "
                "optimizer at flat shards); build it before stepping it"
            )
        # [Note: deferred init]: the engine let only stage 3 have parameters on the meta device
        made = DeferredInit(
            model, self.dp, self.control, self.ctx.param_init_fn, self.cfg.init_method
        )
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if not t.is_meta:  # [Note: deferred init]: made and broadcast unit by unit
                    self.dp.broadcast(t.data, src=0)
        self._buffers = BufferSync(model, self.dp)
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        params = [
            p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) in group_of
        ]
        if self.policy.units_by_module:
            pieces = []
            # A size the user set wins over the blocks a model declares ([Note: units run
            # forward] in zero_units.py); the default size is only the fallback.
            by_size = "unit_min_params" in self.cfg.model_fields_set
            for module, ps in module_units(
                model,
                {id(p) for p in params},
                self.cfg.unit_classes,
                self.cfg.unit_min_params,
                by_size,
            ):
                for chunk in _split(ps, group_of):
                    pieces.append((module, chunk))
            # Launch order approximates backward order: blocks in reverse, but the root unit
            # (embeddings, head) last, since its embedding's gradient is the last to arrive and
            # every later unit would otherwise wait for it ([Note: launch order]).
            root = [pc for pc in pieces if pc[0] is model]
            pieces = [pc for pc in reversed(pieces) if pc[0] is not model] + root
        else:
            pieces = [(None, ps) for ps in bucket_units(params, group_of, self.cfg.bucket_mb)]
        # [Note: tied weights] in tied.py: a weight tied across pipeline stages gets a unit of
        # its own, so its shards line up rank for rank on every stage that holds it.
        pieces = [(m, chunk) for m, ps in pieces for chunk in _isolate(ps, self.ctx.isolated)]
        if self._params_on_disk:  # [Note: parameter offload]: each unit's shards out once built
            self._check_params_offload(model)
            dry = any(isinstance(p, FakeTensor) for p in params)
            self._shards = ShardSwap(self.cfg.offload_param, self.ctx.world.rank, dry)
        module_names = {id(m): n or "root" for n, m in model.named_modules()}
        param_names = {id(p): n for n, p in model.named_parameters()}
        whole: dict[int, list[nn.Parameter]] = {}  # a unit's pieces are made at its first
        for module, ps in pieces:
            whole.setdefault(id(module), []).extend(ps)
        for module, ps in pieces:
            made.unit(whole[id(module)])
            u = FlatUnit(
                len(self.units),
                ps,
                group_of[id(ps[0])],
                self.comm.world_size,
                self.comm.rank,
                module=module,
            )
            # Named in desync and hang reports: two units' tensors may have the same shape.
            what = (
                module_names[id(module)] if module is not None else f"{param_names[id(ps[0])]}, ..."
            )
            u.tag = f"unit {u.index}: {what}"
            self._build(u)
            self.units.append(u)
            if self._shards is not None:
                self._shards.adopt(u)
        self._order = InOrder(len(self.units), self._reduce)
        for g, grp in enumerate(optimizer.param_groups):
            grp["params"] = [pc for u in self.units if u.group == g for *_, pc in u.pieces]
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        made.finish()
        self._offload(optimizer)
        if self.policy.shard_params:
            self._gathering = Gathering(
                self.units,
                self.comm,
                model,
                self.cfg.prefetch,
                lambda: self._order.advance(self._unit_done),
                shards=self._shards,
                record=self._schedule.append,
            )
            self._hooks += self._gathering.install()
        return model

    def _offload(self, optimizer: torch.optim.Optimizer) -> None:
        """The swap files of [Note: optimizer state offload] and [Note: parameter offload],
        when the config asks for disk, and the stream that steps units through them."""
        cfg = self.cfg.offload_optimizer
        for key, c in (("offload_optimizer", cfg), ("offload_param", self.cfg.offload_param)):
            if c.device == "cpu" and any(u.device.type != "cpu" for u in self.units):
                raise ConfigError(
                    f"zero.{key}.device = 'cpu' with parameters on an accelerator: keeping "
                    "state in CPU memory beside an accelerator is not implemented yet; remove "
                    "the key"
                )
        if not self.units or (cfg.device != "disk" and self._shards is None):
            return  # 'cpu' on a CPU: the state is there already
        if has_step_hooks(optimizer):
            raise ConfigError(
                "zero offload to disk steps the optimizer unit by unit, which step hooks would "
                "see several times per step; remove the hooks or the offload keys"
            )
        dry = any(isinstance(u.shard, FakeTensor) for u in self.units)
        homes: list[Any] = []
        if cfg.device == "disk":
            self._swap = StateSwap(cfg, self.units, self.ctx.world.rank)
            if not dry:
                with contextlib.suppress(ValueError):  # an optimizer without a known formula
                    k = optimizer_state_bytes_per_param(optimizer)
                    check_room(self._swap.dir, k * sum(u.shard_numel for u in self.units))
            homes.append(self._swap)
        ahead = cfg.buffer_count if cfg.device == "disk" else self.cfg.offload_param.buffer_count
        self._stream = UnitStream(homes, self.units, ahead, dry)
        if self._shards is not None:
            self._shards.submit = self._stream.submit
            homes.insert(0, self._shards)  # parameters and gradients before the state

    def _check_params_offload(self, model: nn.Module) -> None:
        """What [Note: parameter offload] does not combine with yet, refused by name."""
        mesh = self.ctx.topology.mesh
        for axis, size in (("pp", mesh.pp), ("tp", mesh.tp), ("dp_replicate", mesh.dp_replicate)):
            if size > 1:
                raise ConfigError(
                    f"zero.offload_param.device = 'disk' with mesh.{axis} = {size}: parameter "
                    f"offload is implemented for plain ZeRO-3 (mesh.{axis} = 1) so far; remove "
                    "the key or the axis"
                )
        device = next(model.parameters()).device
        if device.type not in ("cpu", "meta"):
            raise ConfigError(
                f"zero.offload_param.device = 'disk' with parameters on {device}: offload to "
                "disk is implemented for CPU training only so far; remove the key"
            )

    @property
    def offloaded(self) -> dict[str, int] | None:
        """With offload to disk: bytes on disk, and bytes read and written so far (``moved``:
        both)."""
        if self._stream is None:
            return None
        homes = [h for h in (self._swap, self._shards) if h is not None]
        return {
            "disk": sum(self.on_disk.values()),
            "moved": sum(h.moved for h in homes),
            "read": sum(h.read_bytes for h in homes),
            "written": sum(h.written_bytes for h in homes),
        }

    @property
    def deferred_init(self) -> bool:
        """Whether a model on the meta device can be made here ([Note: deferred init])."""
        return self.policy.shard_params

    @property
    def on_disk(self) -> dict[str, int]:
        """Bytes of model state this rank keeps on disk, per category."""
        out = dict(self._shards.disk_bytes) if self._shards is not None else {}
        if self._swap is not None:
            out["optimizer_state"] = self._swap.disk_bytes
        return out

    def held_gradients(self) -> ShardSwap | None:
        """Gradients kept out of memory ([Note: parameter offload]): the engine's clipping
        asks them for their sum of squares and hands them its factor."""
        return self._shards

    def _build(self, u: FlatUnit) -> None:
        for i, p in enumerate(u.params):
            self.where[id(p)] = (u, i)
        if self.policy.shard_params:
            u.shard = u.flatten(u.lo, u.hi)  # only the shard: the rest is never materialised
            u.release_params()
            u.state = UnitState.SHARDED
        else:
            flat = u.flatten()
            u.flat_param = flat
            u.point_params_at(flat)
            u.shard = flat[u.lo : u.hi]  # a view: the step updates flat in place
        u.make_pieces(u.shard)
        if self.policy.shard_grads:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)
        else:  # accumulates over the step's micro-batches
            u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)

    # -- gradients -----------------------------------------------------------------------------

    def before_forward(self) -> None:
        self._schedule.clear()  # [Note: stage-3 shadow]: a new micro-batch's record

    def before_backward(self, sync: bool) -> None:
        if self._gathering is not None and self._gathering.held:
            raise RuntimeError(
                "engine.backward() inside engine.gathered_parameters(): that "
                "context is for evaluation; leave it (on every rank) to train"
            )
        self.wait_gradients()  # stages 2-3: the last micro-batch's reductions land in the shard
        self._sync = sync
        self._order.reset()
        for u in self.units:
            u.arrived.clear()
            u.backward_done = False

    def after_backward(self) -> None:
        if self.policy.reduces_now(self._sync):
            # Units some parameter of which this backward did not reach (unused on this
            # micro-batch, or on this rank) are launched now, in order ([Note: launch order]),
            # before any other collective: ranks that completed them during backward did so.
            self._order.advance(self._unit_done, force=True)
        if self._gathering is not None:
            self._replay = list(self._schedule)  # [Note: stage-3 shadow]
        assert self._buffers is not None
        self._buffers.after_backward()
        if self._gathering is not None:
            self._gathering.backward_over()

    def shadow(self) -> None:
        """[Note: joining] in join.py. Stages 1-2: ``after_backward`` launches every unit (zeros,
        or what earlier micro-batches of the step accumulated); stage 3 also replays the
        gathers ([Note: stage-3 shadow])."""
        assert self._buffers is not None
        self._buffers.shadow()
        if self._gathering is None:
            return
        if self._replay is None:
            raise RuntimeError(
                f"zero-3: data-parallel rank {self.dp.rank} ran out of batches before its first "
                "micro-batch, so it has no record of the units' gathers to replay while the "
                "others train ([Note: stage-3 shadow]); give every rank at least one micro-batch"
            )
        replay, gathering = self._replay, self._gathering
        self._schedule.clear()
        for kind, index in replay:
            if kind == "gather":
                u = self.units[index]
                gathering.free(u)  # (every unit is sharded between micro-batches)
                gathering.ready(u)
                gathering.free(u)
            else:  # the reductions go in unit order: this launches exactly unit ``index``
                self._order.advance(lambda i, last=index: i <= last)

    def buffers_from(self, rank: int) -> None:
        assert self._buffers is not None
        self._buffers.source = rank

    def _unit_done(self, index: int) -> bool:
        """Whether unit ``index``'s gradients of this backward are all in: for stage 3, on an
        event every rank sees alike ([Note: stage-3 order])."""
        u = self.units[index]
        return u.backward_done if self.policy.shard_params else u.complete

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self.where[id(p)]
        assert p.grad is not None
        if p.grad.shape != u.shapes[i]:  # read while its unit was not gathered
            raise ConfigError(
                f"zero-3: a parameter of {u.tag} ({type(u.module).__name__}) was used while its "
                "unit was not gathered: its module's forward did not run, and another module "
                f"read its parameters directly ([Note: units run forward]); {UNIT_FIX}"
            )
        if u.flat_grad is None:  # stages 2-3: a transient buffer per backward
            # On one data-parallel rank the shard is the whole unit: gradients accumulate in
            # it directly, with nothing to reduce (no more memory than a single process).
            u.flat_grad = (
                u.grad_shard
                if self._alone
                else torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            )
        assert p.grad is not None
        u.view(u.flat_grad, i).add_(p.grad)
        p.grad = None  # the flat buffer holds it now; free the full-size gradient
        u.arrived.add(i)
        u.used.add(i)
        if self._order.launched(u.index):  # its reduction is on the wire without this gradient
            raise RuntimeError(
                f"zero: a gradient of {u.tag} arrived after its reduction started (stage "
                f"{self.policy.stage}); autograd ran its accumulation after the unit's backward "
                "ended. Please report this with the model; stage 2 does not depend on that order"
            )
        if not self.policy.shard_params and self.policy.reduces_now(self._sync):
            self._order.advance(self._unit_done)
        self._reap()

    def _reduce(self, index: int) -> None:
        """Launch unit ``index``'s reduce-scatter (what the in-order launcher calls)."""
        u = self.units[index]
        if self._alone:
            u.flat_grad = None  # it was the gradient shard itself: nothing to reduce
            return
        if u.flat_grad is None:  # no parameter of this unit was used
            u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
        # The average over every data-parallel rank: the shard group sums now, the replicas
        # at the boundary (gloo has no AVG: divide first).
        u.flat_grad.div_(self.dp.world_size)
        c = self.compressor
        if c is not None and c.compressing and self.comm.world_size > 1:  # [Note: compressed ZeRO]
            spans = list(zip(u.offsets, u.shapes, strict=True))
            c.all_reduce(f"unit {index}", u.flat_grad, spans, self.comm)
            u.reduced = u.flat_grad[u.lo : u.hi].clone()
            u.shard_empty = False
            if self._gathering is not None:
                self._schedule.append(("reduce", index))  # [Note: stage-3 shadow]
            u.reduce_handle = compression.Done()
            return
        # precision.communication_data_type: gradients travel (and are summed) in that
        # dtype, and land back in the fp32 shard in wait_gradients.
        send = u.flat_grad if self._wire in (None, u.dtype) else u.flat_grad.to(self._wire)
        if (
            self.policy.shard_grads
            and u.shard_empty
            and send.dtype == u.dtype
            and self._shards is None  # on disk: the shard has no memory to land in
        ):
            # [Note: reduce in place] The shard holds nothing yet this step: the reduction
            # lands in it directly, and no shard-size buffer per unit in flight is needed
            # (with every unit in flight at the end of a backward, 2 bytes per parameter in fp32
            # at two ranks, the whole difference to DeepSpeed's peak in zero_vs_peers).
            u.reduced = u.grad_shard
        else:
            u.reduced = torch.empty(u.shard_numel, dtype=send.dtype, device=u.device)
        u.shard_empty = False
        if self._gathering is not None:
            self._schedule.append(("reduce", index))  # [Note: stage-3 shadow]
        # Stages 2-3 drop the full-size buffer once the shard landed, and a cast copy is
        # nobody's: the doorway may reduce in it ([Note: gloo reduce-scatter]).
        scratch = self.policy.shard_grads or send is not u.flat_grad
        u.reduce_handle = self.ctx.topology.reducer("dp_shard", index).reduce_scatter(
            u.reduced, send, async_op=True, tag=u.tag, scratch=scratch
        )
        if self._shards is not None:
            # [Note: parameter offload]: memory is what offload is for, so at most
            # buffer_count reductions (each a full-size gradient buffer and a shard) are in
            # flight; without a bound, a backward that outruns the wire holds every unit's.
            flying = [v for v in self.units[: index + 1] if v.reduced is not None]
            for v in flying[: max(len(flying) - self._shards.limit, 0)]:
                self._land(v)

    def _land(self, u: FlatUnit) -> None:
        """Wait for ``u``'s reduce-scatter; its result joins the gradient shard (stages 2-3,
        which then drop the full-size buffer) or becomes it (stage 1)."""
        u.reduce_handle.wait()  # type: ignore[union-attr]
        u.reduce_handle = None
        assert u.reduced is not None
        if self._shards is not None:  # [Note: parameter offload]: to the unit's file
            self._shards.land(u, u.reduced)
            u.flat_grad = None
        elif self.policy.shard_grads:
            assert u.grad_shard is not None
            if u.reduced is not u.grad_shard:  # [Note: reduce in place]
                u.grad_shard.add_(u.reduced)
            u.flat_grad = None
        else:
            assert u.flat_grad is not None
            u.flat_grad[u.lo : u.hi].copy_(u.reduced)
        u.reduced = None

    def _reap(self) -> None:
        """Land the reductions that are over already, freeing their full-size buffers while
        backward still runs (stages 2-3)."""
        if not self.policy.shard_grads:
            return
        for u in self.units[: self._order.next]:
            if u.reduced is not None and _completed(u.reduce_handle):
                self._land(u)

    def finish_gradients(self) -> None:
        self._order.advance(self._unit_done, force=True)
        self._sync = False
        self._reduce_replicas = True
        # [Note: unused parameters]: which parameters some rank used in this step.
        if self.control.world_size > 1 and self.units:  # a small CPU vector: control plane
            used = [float(i in u.used) for u in self.units for i in range(len(u.params))]
            self._usage = torch.tensor(used, dtype=torch.float32)
            self._usage_handle = self.control.all_reduce(self._usage, op="max", async_op=True)

    def wait_gradients(self) -> None:
        for u in self.units:
            if u.reduced is not None:
                self._land(u)
        if self._reduce_replicas:  # once per step, after the last micro-batch's reductions
            self._reduce_replicas = False
            for u in self.units:
                self.replicas.all_reduce(u.grad_view())

    def _used_by_any_rank(self) -> list[set[int]]:
        """Per unit, the parameters some rank used in this step ([Note: unused parameters])."""
        usage, handle = self._usage, self._usage_handle
        self._usage = self._usage_handle = None
        if usage is None or not self.control.active:  # one rank, or the planner's meta run
            return [set(u.used) for u in self.units]
        handle.wait()  # type: ignore[union-attr]
        flags = iter(usage.tolist())
        return [{i for i in range(len(u.params)) if next(flags) > 0} for u in self.units]

    def norm_groups(self) -> list[Comm]:
        return [self.comm]  # shards are disjoint within the shard group, equal across replicas

    def local_gradients(self) -> list[torch.Tensor]:
        if self._shards is not None:  # on disk: see held_gradients
            return []
        return [u.grad_view() for u in self.units]

    def _grad_pieces(self, u: FlatUnit) -> list[torch.Tensor]:
        """The optimizer's gradient views, one per piece of ``u``'s shard."""
        if self._shards is not None:
            return self._shards.grad_pieces[u.index]
        grad = u.grad_view()
        return [grad[a:b] for _, a, b, _ in u.pieces]

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        u, _ = self.where[id(param)]
        assert len(u.params) == 1, "a tied parameter has a unit of its own (see setup)"
        return u.grad_view()

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        u, i = self.where[id(param)]
        for j, a, b, _ in u.pieces:
            if j == i:
                return u.grad_view()[a:b]
        return None  # the parameter lies outside this rank's shard

    # -- the step ------------------------------------------------------------------------------

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.wait_gradients()
        for u, used in zip(self.units, self._used_by_any_rank(), strict=True):
            views = self._grad_pieces(u)
            for (i, *_, piece), g in zip(u.pieces, views, strict=True):
                piece.grad = g if i in used else None
        if self._gathering is not None:
            self._gathering.free_all()  # a buffer gathered before the step holds stale values
            if self._stream is not None:
                self._each_unit(optimizer, lambda u: None)
            else:
                optimizer.step()
        else:
            self._step_and_gather(optimizer)
        if self._shards is not None:
            self._shards.step_over()
        for u in self.units:
            if self._shards is None:  # on disk, the next step's first reduction overwrites it
                u.grad_view().zero_()
            u.shard_empty = True
            u.used.clear()
            for *_, piece in u.pieces:
                piece.grad = None
            if not self.policy.shard_grads:
                assert u.flat_grad is not None
                u.flat_grad.zero_()
        if self.compressor is not None:
            self.compressor.step_done()  # the warm-up counts optimizer steps

    def _step_and_gather(self, optimizer: torch.optim.Optimizer) -> None:
        """Stages 1-2: the updated shards are all-gathered into every rank's full flat
        parameters. An element-wise optimizer without step hooks steps unit by unit, each
        unit's all-gather starting while the next unit steps (as replicate's buckets do,
        [Note: optimizer overlap] in ``replicate.py``)."""
        by_unit = is_elementwise(optimizer) and not has_step_hooks(optimizer)
        handles = []

        def gather(u: FlatUnit) -> None:
            assert u.shard is not None and u.flat_param is not None
            handles.append(
                self.comm.all_gather(u.flat_param, u.shard.clone(), async_op=True, tag=u.tag)
            )

        if by_unit or self._stream is not None:  # _offload refused step hooks
            self._each_unit(optimizer, gather)
        else:
            optimizer.step()
            for u in self.units:
                gather(u)
        for h in handles:
            h.wait()

    def _each_unit(self, optimizer: torch.optim.Optimizer, after: Any) -> None:
        """Step unit by unit, then ``after(unit)``: every piece's gradient is set aside and each
        unit's given back for its own ``step()`` (an element-wise optimizer steps only pieces
        with a gradient); with offload, each unit's state is brought in around it."""
        grads = {id(pc): pc.grad for u in self.units for *_, pc in u.pieces}
        for u in self.units:
            for *_, pc in u.pieces:
                pc.grad = None

        def step_unit(u: FlatUnit) -> None:
            for *_, pc in u.pieces:
                pc.grad = grads[id(pc)]
            optimizer.step()
            for *_, pc in u.pieces:
                pc.grad = None
            after(u)

        if self._stream is not None:
            self._stream.step(optimizer, step_unit)
        else:
            for u in self.units:
                step_unit(u)

    # -- state ---------------------------------------------------------------------------------

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = [u.shard for u in self.units if u.shard is not None]
        params += [u.flat_param for u in self.units if u.flat_param is not None]
        grads = [t for u in self.units for t in (u.flat_grad, u.grad_shard) if t is not None]
        comm = [u.reduced for u in self.units if u.reduced is not None]
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": optimizer_state_tensors(optimizer),
            "communication_buffers": comm,
        }

    def hooked_modules(self) -> list[nn.Module]:
        """Stage 3: the modules whose forward its hooks gather parameters around (each
        unit's, the root's last), which compiling keeps out of its graphs ([Note: compiling
        under a strategy] in ``longboat/compile.py``); stages 1-2 hook no forward."""
        if self._gathering is None:
            return []
        modules = {id(u.module): u.module for u in self.units if u.module is not None}
        return list(modules.values())

    def gathered_parameters(self) -> contextlib.AbstractContextManager[None]:
        """Stage 3: every unit gathered while inside (entering and leaving are collective), so
        that any rank may run forwards alone, e.g. an evaluation on rank 0 under no_grad.
        Read-only: changes to parameters inside are not kept. Stages 1-2 hold whole
        parameters already: nothing to do."""
        if self._gathering is None:
            return contextlib.nullcontext()
        return self._gathering.holding()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` with every parameter whole (gathered for stage 3)."""
        with self.gathered_parameters():
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        if self._stream is None:
            return zero_state.rank_state(self.units, model, optimizer, self.dp, self.replicas)
        # The pieces copy what they hold; then out again.
        if self._gathering is not None:
            self._gathering.free_all()
        if self._shards is not None:
            self._shards.bring_all_params()
        if self._swap is not None:
            self._swap.bring_all(optimizer)
        try:
            state = zero_state.rank_state(self.units, model, optimizer, self.dp, self.replicas)
            if self._shards is not None:  # the pieces are views of shards about to be dropped
                shards = {u.shard.untyped_storage().data_ptr() for u in self.units}  # type: ignore[union-attr]
                for pc in state.pieces:
                    if pc.tensor.untyped_storage().data_ptr() in shards:
                        pc.tensor = pc.tensor.clone()
            return state
        finally:
            if self._swap is not None:
                self._swap.drop_all(optimizer)
            if self._shards is not None:
                self._shards.drop_all_params()

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        if self._gathering is not None:
            self._gathering.free_all()  # a buffer gathered earlier would be stale after this
        if self._shards is not None:
            self._shards.bring_all_params()
        zero_state.load(self.units, model, optimizer, source)
        if self._swap is not None:
            self._swap.store_all(optimizer)
        if self._shards is not None:
            self._shards.store_all_params()

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """[Note: memory formulas] for this stage; offloaded optimizer state is on disk."""
        out = expected_bytes(self.name, a, self.comm.world_size, k)
        for category in self.on_disk:
            out[category] = 0
        return out

    def close(self) -> None:
        if self._swap is not None:
            self._swap.close()
            self._swap = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._buffers is not None:
            self._buffers.close()
        if self._gathering is not None:  # hand the user back an ordinary model
            for u in self.units:
                self._gathering.ready(u)
                for i, p in enumerate(u.params):
                    p.data = u.view(u.flat_param, i).clone()  # type: ignore[arg-type]
                u.flat_param, u.state = None, UnitState.SHARDED
                if u.full is not None:
                    free_storage(u.full)
        if self._shards is not None:  # after the gathers above, which read its files
            self._shards.close()
            self._shards = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _completed(handle: object) -> bool:
    done = getattr(handle, "is_completed", None)
    return bool(done()) if done is not None else False


def _isolate(params: list[nn.Parameter], isolated: frozenset[int]) -> list[list[nn.Parameter]]:
    """``params`` as units: each isolated parameter alone, then the others together."""
    rest = [p for p in params if id(p) not in isolated]
    return [[p] for p in params if id(p) in isolated] + ([rest] if rest else [])


def _split(params: list[nn.Parameter], group_of: dict[int, int]) -> list[list[nn.Parameter]]:
    out: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        out.setdefault((group_of[id(p)], p.dtype, p.device), []).append(p)
    return list(out.values())
