"""ZeRO: sharded data parallelism, stages 1, 2 and 3, built from flat units (see
:mod:`longboat.strategies.flat`).

- stage 1: optimizer state sharded. Gradients accumulate in a full flat buffer; at the boundary
  it is reduce-scattered, each rank steps its shard, and the shards are all-gathered back.
- stage 2: gradients sharded too. A unit's gradients are reduce-scattered as soon as its last
  gradient arrives during backward (every micro-batch), and only the shard is kept.
- stage 3: parameters sharded too. A unit's module gathers its parameters just before its
  forward and again before its backward (the next unit's gather prefetched), and frees them
  right after each.

The optimizer the user built is re-targeted at one flat shard per unit, so any element-wise
``torch.optim`` optimizer (SGD, Adam, AdamW, ...) works unchanged; gradients, per-element states
and weight decay are then exactly those of the unsharded run.

[Note: reduction order] Units launch their reduce-scatters strictly in unit order on every rank
(as replicate's buckets do), because collectives are matched by order across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from longboat.config import ConfigError
from longboat.observe.memory import optimizer_state_tensors
from longboat.optim import ELEMENTWISE_OPTIMIZERS
from longboat.precision import DTYPES
from longboat.strategies import zero_state
from longboat.strategies.base import StrategyContext
from longboat.strategies.flat import FlatUnit
from longboat.strategies.pieces import PieceSource, RankState
from longboat.strategies.zero_units import bucket_units, module_units


class Zero:
    """ZeRO stages 1-3 behind the :class:`~longboat.strategies.base.Strategy` protocol."""

    name = "zero"
    grads_sharded = True

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.comm = ctx.comm
        self.cfg = ctx.config.zero
        self.stage = self.cfg.stage
        self.units: list[FlatUnit] = []
        self.where: dict[int, tuple[FlatUnit, int]] = {}
        self.frozen: list[torch.Tensor] = []
        self._hooks: list[RemovableHandle] = []
        self._sync = False
        self._next = 0  # next unit to launch, see [Note: reduction order]
        self._fwd_order: list[FlatUnit] = []
        self._recording = True
        self._in_flight = False
        wire = ctx.config.precision.communication_data_type
        self._wire = DTYPES[wire] if wire else None
        self.name = f"zero-{self.stage}"

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            raise ConfigError(
                f"strategy 'zero' steps the optimizer on flat shards, which is exact only for "
                f"element-wise optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}"
                f"); {type(optimizer).__name__} couples elements of a tensor. Use strategy "
                "'replicate', or one of those optimizers"
            )
        if optimizer.state:
            raise ConfigError("strategy 'zero' needs a fresh optimizer (it re-targets the "
                              "optimizer at flat shards); build it before stepping it")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                self.comm.broadcast(t.data, src=0)
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups)
                    for p in grp["params"]}
        params = [p for p in dict.fromkeys(model.parameters())
                  if p.requires_grad and id(p) in group_of]
        chosen = {id(p) for p in params}
        self.frozen = [p for p in model.parameters() if id(p) not in chosen]
        if self.stage == 3:
            pieces = []
            for module, ps in module_units(model, {id(p) for p in params},
                                           self.cfg.unit_classes, self.cfg.unit_min_params):
                for chunk in _split(ps, group_of):
                    pieces.append((module, chunk))
            # Launch order approximates backward order: blocks in reverse, but the root unit
            # (embeddings, head) last, since its embedding's gradient is the last to arrive and
            # every later unit would otherwise wait for it ([Note: reduction order]).
            root = [pc for pc in pieces if pc[0] is model]
            pieces = [pc for pc in reversed(pieces) if pc[0] is not model] + root
        else:
            pieces = [(None, ps) for ps in bucket_units(params, group_of, self.cfg.bucket_mb)]
        for module, ps in pieces:
            u = FlatUnit(len(self.units), ps, group_of[id(ps[0])], self.comm.world_size,
                         self.comm.rank, module=module)
            self._build(u)
            self.units.append(u)
        for g, grp in enumerate(optimizer.param_groups):
            grp["params"] = [u.shard for u in self.units if u.group == g]
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.stage == 3:
            self._install_gather_hooks()
        return model

    def _build(self, u: FlatUnit) -> None:
        flat = u.flatten()
        for i, p in enumerate(u.params):
            self.where[id(p)] = (u, i)
        if self.stage < 3:
            u.flat_param = flat
            u.point_params_at(flat)
            u.shard = nn.Parameter(flat[u.lo: u.hi])  # a view: the step updates flat in place
        else:
            u.shard = nn.Parameter(flat[u.lo: u.hi].clone())
            u.release_params()
        if self.stage == 1:
            u.flat_grad = torch.zeros_like(flat)
        else:
            u.grad_shard = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)

    # -- stage 3: gather before use, free after ------------------------------------------------

    def _install_gather_hooks(self) -> None:
        by_module: dict[int, list[FlatUnit]] = {}
        for u in self.units:
            by_module.setdefault(id(u.module), []).append(u)
        for us in by_module.values():
            m = us[0].module
            assert m is not None
            self._hooks.append(m.register_forward_pre_hook(
                lambda _m, _a, us=us: self._before_unit_forward(us)))
            self._hooks.append(m.register_forward_hook(
                lambda _m, _a, out, us=us: self._after_unit_forward(us, out)))

    def _gather(self, u: FlatUnit, async_op: bool = False) -> None:
        if u.flat_param is not None:
            return
        assert u.shard is not None
        full = torch.empty(u.padded, dtype=u.dtype, device=u.device)
        u.gather_handle = self.comm.all_gather(full, u.shard.detach(), async_op=async_op)
        u.flat_param = full

    def _ready(self, u: FlatUnit) -> None:
        """Make ``u``'s parameters usable: gather (or finish a prefetch) and point at it."""
        self._gather(u)
        if u.gather_handle is not None:
            u.gather_handle.wait()  # type: ignore[attr-defined]
            u.gather_handle = None
        assert u.flat_param is not None
        u.point_params_at(u.flat_param)

    def _free(self, u: FlatUnit) -> None:
        if u.gather_handle is not None:  # a prefetch in flight must land before its buffer goes
            u.gather_handle.wait()  # type: ignore[attr-defined]
            u.gather_handle = None
        u.release_params()
        u.flat_param = None

    def _prefetch(self, us: list[FlatUnit], step: int) -> None:
        if not self.cfg.prefetch or self._recording or not self._fwd_order:
            return
        pos = self._fwd_order.index(us[-1] if step > 0 else us[0]) + step
        if 0 <= pos < len(self._fwd_order):
            u = self._fwd_order[pos]
            if step < 0 and u.complete:
                return  # its backward is already over: gathering again would only waste memory
            self._gather(u, async_op=True)

    def _before_unit_forward(self, us: list[FlatUnit]) -> None:
        for u in us:
            self._ready(u)
            if self._recording and u not in self._fwd_order:
                self._fwd_order.append(u)
        self._prefetch(us, +1)

    def _after_unit_forward(self, us: list[FlatUnit], out: Any) -> None:
        for u in us:
            self._free(u)
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors(out) if t.requires_grad]
        for t in tensors:
            t.register_hook(lambda g, us=us: self._before_unit_backward(us) or g)

    def _before_unit_backward(self, us: list[FlatUnit]) -> None:
        self._recording = False  # the first forward fixed the order prefetching follows
        for u in us:
            self._ready(u)
        self._prefetch(us, -1)

    # -- gradients -----------------------------------------------------------------------------

    def before_forward(self) -> None:
        pass

    def before_backward(self, sync: bool) -> None:
        if self._in_flight:  # stages 2-3 between boundaries: finish the last micro-batch's
            self._launch(force=True)
            self.wait_gradients()
        self._in_flight = False
        self._sync = sync
        self._next = 0
        for u in self.units:
            u.arrived.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self.where[id(p)]
        if u.flat_grad is None:  # stages 2-3: a transient buffer per backward
            u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
        assert p.grad is not None
        u.view(u.flat_grad, i).add_(p.grad)
        p.grad = None  # the flat buffer holds it now; free the full-size gradient
        u.arrived.add(i)
        self._in_flight = self.stage >= 2 or self._sync
        if self.stage == 3 and u.complete:
            self._free(u)  # this unit's backward is over
        if self.stage >= 2 or self._sync:
            self._launch(force=False)

    def _launch(self, force: bool) -> None:
        while self._next < len(self.units):
            u = self.units[self._next]
            if not (u.complete or force):
                return
            if u.flat_grad is None:  # no parameter of this unit was used
                u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            u.flat_grad.div_(self.comm.world_size)  # gloo has no AVG
            # precision.communication_data_type: gradients travel (and are summed) in that
            # dtype, and land back in the fp32 shard in wait_gradients.
            send = u.flat_grad if self._wire in (None, u.dtype) else u.flat_grad.to(self._wire)
            u.reduced = torch.empty(u.shard_numel, dtype=send.dtype, device=u.device)
            u.reduce_handle = self.comm.reduce_scatter(u.reduced, send, async_op=True)
            self._next += 1

    def finish_gradients(self) -> None:
        self._launch(force=True)
        self._sync = False
        self._in_flight = False

    def wait_gradients(self) -> None:
        for u in self.units:
            if u.reduced is None:
                continue
            u.reduce_handle.wait()  # type: ignore[union-attr]
            u.reduce_handle = None
            if self.stage == 1:
                assert u.flat_grad is not None
                u.flat_grad[u.lo: u.hi].copy_(u.reduced)
            else:
                assert u.grad_shard is not None
                u.grad_shard.add_(u.reduced)
                u.flat_grad = None
            u.reduced = None

    def local_gradients(self) -> list[torch.Tensor]:
        return [u.grad_view() for u in self.units]

    # -- the step ------------------------------------------------------------------------------

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.wait_gradients()
        for u in self.units:
            assert u.shard is not None
            u.shard.grad = u.grad_view()
        optimizer.step()
        if self.stage == 3:
            for u in self.units:  # a buffer gathered before the step holds stale values
                self._free(u)
        else:
            handles = []
            for u in self.units:
                assert u.shard is not None and u.flat_param is not None
                handles.append(self.comm.all_gather(u.flat_param, u.shard.detach().clone(),
                                                    async_op=True))
            for h in handles:
                h.wait()
        for u in self.units:
            u.grad_view().zero_()
            if self.stage == 1:
                assert u.flat_grad is not None
                u.flat_grad.zero_()

    # -- state ---------------------------------------------------------------------------------

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = [u.shard for u in self.units if u.shard is not None]
        params += [u.flat_param for u in self.units if u.flat_param is not None]
        grads = [t for u in self.units for t in (u.flat_grad, u.grad_shard) if t is not None]
        comm = [u.reduced for u in self.units if u.reduced is not None]
        return {"parameters": params, "gradients": grads,
                "optimizer_state": optimizer_state_tensors(optimizer),
                "communication_buffers": comm}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` with every parameter whole (gathered for stage 3)."""
        if self.stage < 3:
            return model.state_dict()
        # Between steps no unit needs to stay gathered (a stray prefetch is dropped too).
        for u in self.units:
            self._ready(u)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for u in self.units:
            self._free(u)
        return state

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                         ) -> RankState:
        return zero_state.rank_state(self, model, optimizer)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                              source: PieceSource) -> None:
        zero_state.load(self, model, optimizer, source)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.stage == 3:  # hand the user back an ordinary model with whole parameters
            for u in self.units:
                self._ready(u)
                for i, p in enumerate(u.params):
                    p.data = u.view(u.flat_param, i).clone()  # type: ignore[arg-type]
                u.flat_param = None


def _split(params: list[nn.Parameter], group_of: dict[int, int]) -> list[list[nn.Parameter]]:
    out: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        out.setdefault((group_of[id(p)], p.dtype, p.device), []).append(p)
    return list(out.values())


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []
