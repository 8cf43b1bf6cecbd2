"""ZeRO: sharded data parallelism, stages 1, 2 and 3, built from flat units (see
:mod:`longboat.strategies.flat`).

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

[Note: reduction order] Units launch their reduce-scatters strictly in unit order on every rank
(as replicate's buckets do), because collectives are matched by order across ranks.

[Note: stage-3 order] Stage 3 mixes two kinds of collective during backward: the gathers of the
units still to run and the reduce-scatters of those done. Collectives are matched by order, so
both must be issued at events every rank sees alike, never at "this rank has all of the unit's
gradients", which differs between ranks when a parameter is used on some ranks only (a routed
expert inside a unit). Gathers happen when a unit's outputs receive their gradients (before its
backward); a unit's backward is over when the gradients of its inputs exist, which
:class:`_PostBackward` (an identity on the inputs, as FSDP2's post-backward hook) reports; its
reduce-scatter is launched then, or, for a unit whose inputs need no gradient (the first, the
root), once the whole backward returned. Each rank must run the same units in the same order: a
unit whose module runs on some ranks only (a routed expert as a unit of its own) cannot be
gathered by the others, and the desync check names it (each gather and reduce-scatter carries its
unit's tag); put such modules inside a unit that always runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from longboat.config import ConfigError
from longboat.observe.memory import optimizer_state_tensors
from longboat.optim import describe_elementwise, is_elementwise
from longboat.precision import DTYPES
from longboat.strategies import zero_state
from longboat.strategies.base import StrategyContext
from longboat.strategies.buffers import BufferSync
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
        self._buffers: BufferSync | None = None
        self._usage: torch.Tensor | None = None  # the step's usage, all-reduced (in flight)
        self._usage_handle: object | None = None
        self._held = False  # stage 3: parameters kept gathered (gathered_parameters)
        wire = ctx.config.precision.communication_data_type
        self._wire = DTYPES[wire] if wire else None
        self.name = f"zero-{self.stage}"

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if not is_elementwise(optimizer):
            raise ConfigError(
                f"strategy 'zero' steps the optimizer on pieces of flat shards, which is exact "
                f"only for element-wise optimizers: {describe_elementwise()}; "
                f"{type(optimizer).__name__} is not one of them (it may couple elements of a "
                "tensor). Use strategy 'replicate', or one of those optimizers"
            )
        if optimizer.state:
            raise ConfigError("strategy 'zero' needs a fresh optimizer (it re-targets the "
                              "optimizer at flat shards); build it before stepping it")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                self.comm.broadcast(t.data, src=0)
        self._buffers = BufferSync(model, self.comm)
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
        module_names = {id(m): n or "root" for n, m in model.named_modules()}
        param_names = {id(p): n for n, p in model.named_parameters()}
        for module, ps in pieces:
            u = FlatUnit(len(self.units), ps, group_of[id(ps[0])], self.comm.world_size,
                         self.comm.rank, module=module)
            # Named in desync and hang reports: two units' tensors may have the same shape.
            what = (module_names[id(module)] if module is not None
                    else f"{param_names[id(ps[0])]}, ...")
            u.tag = f"unit {u.index}: {what}"
            self._build(u)
            self.units.append(u)
        for g, grp in enumerate(optimizer.param_groups):
            grp["params"] = [pc for u in self.units if u.group == g for *_, pc in u.pieces]
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
            u.shard = flat[u.lo: u.hi]  # a view: the step updates flat in place
        else:
            u.shard = flat[u.lo: u.hi].clone()
            u.release_params()
        u.make_pieces(u.shard)
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
                lambda _m, args, kwargs, us=us: self._before_unit_forward(us, args, kwargs),
                with_kwargs=True))
            self._hooks.append(m.register_forward_hook(
                lambda _m, _a, out, us=us: self._after_unit_forward(us, out)))

    def _gather(self, u: FlatUnit, async_op: bool = False) -> None:
        if u.flat_param is not None:
            return
        assert u.shard is not None
        full = torch.empty(u.padded, dtype=u.dtype, device=u.device)
        u.gather_handle = self.comm.all_gather(full, u.shard, async_op=async_op, tag=u.tag)
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
        if self._held:
            return  # gathered_parameters(): kept until every rank leaves it
        if u.gather_handle is not None:  # a prefetch in flight must land before its buffer goes
            u.gather_handle.wait()  # type: ignore[attr-defined]
            u.gather_handle = None
        u.release_params()
        u.flat_param = None

    def _prefetch(self, us: list[FlatUnit], step: int) -> None:
        if not self.cfg.prefetch or self._recording or not self._fwd_order:
            return
        anchor = us[-1] if step > 0 else us[0]
        if anchor not in self._fwd_order:  # a unit the first forward did not run
            return
        pos = self._fwd_order.index(anchor) + step
        if 0 <= pos < len(self._fwd_order):
            u = self._fwd_order[pos]
            if step < 0 and u.backward_done:
                return  # its backward is already over: gathering again would only waste memory
            self._gather(u, async_op=True)

    def _before_unit_forward(self, us: list[FlatUnit], args: tuple[Any, ...],
                             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # Only a training forward (as in [Note: buffers]) is followed by a backward on every
        # rank; another (an evaluation, maybe on one rank) must leave no trace that one rank has
        # and another has not.
        training = us[0].module.training and torch.is_grad_enabled()  # type: ignore[union-attr]
        for u in us:
            self._ready(u)
            if training and self._recording and u not in self._fwd_order:
                self._fwd_order.append(u)
        self._prefetch(us, +1)
        return self._watch_inputs(us, args, kwargs) if training else (args, kwargs)

    def _watch_inputs(self, us: list[FlatUnit], args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """[Note: stage-3 order]: pass the inputs that need a gradient through
        :class:`_PostBackward`, whose backward runs once the unit's backward is over."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return args, kwargs  # e.g. the first unit: handled when the backward is over
        for u in us:
            u.calls += 1
        watched = _PostBackward.apply(lambda: self._after_unit_backward(us),
                                      *(flat[i] for i in where))
        for i, t in zip(where, watched, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

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

    def _after_unit_backward(self, us: list[FlatUnit]) -> None:
        for u in us:
            u.calls -= 1
            if u.calls == 0:  # the last of the module's calls in this forward
                u.backward_done = True
                self._free(u)
        self._launch(force=False)

    # -- gradients -----------------------------------------------------------------------------

    def before_forward(self) -> None:
        pass

    def before_backward(self, sync: bool) -> None:
        if self._held:
            raise RuntimeError("engine.backward() inside engine.gathered_parameters(): that "
                               "context is for evaluation; leave it (on every rank) to train")
        self.wait_gradients()  # stages 2-3: the last micro-batch's reductions land in the shard
        self._sync = sync
        self._next = 0
        for u in self.units:
            u.arrived.clear()
            u.backward_done = False

    def after_backward(self) -> None:
        if self.stage >= 2 or self._sync:
            # Units some parameter of which this backward did not reach (unused on this
            # micro-batch, or on this rank) are launched now, in order ([Note: reduction order]),
            # before any other collective: ranks that completed them during backward did so.
            self._launch(force=True)
        assert self._buffers is not None
        self._buffers.after_backward()
        if self.stage == 3:
            for u in self.units:  # the backward is over: nothing needs them gathered
                u.calls = 0
                self._free(u)

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self.where[id(p)]
        if u.flat_grad is None:  # stages 2-3: a transient buffer per backward
            u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
        assert p.grad is not None
        u.view(u.flat_grad, i).add_(p.grad)
        p.grad = None  # the flat buffer holds it now; free the full-size gradient
        u.arrived.add(i)
        u.used.add(i)
        if u.index < self._next:  # its reduction is already on the wire without this gradient
            raise RuntimeError(
                f"zero: a gradient of {u.tag} arrived after its reduction started (stage "
                f"{self.stage}); autograd ran its accumulation after the unit's backward ended. "
                "Please report this with the model; stage 2 does not depend on that order")
        if self.stage < 3 and (self.stage == 2 or self._sync):
            self._launch(force=False)

    def _launch(self, force: bool) -> None:
        while self._next < len(self.units):
            u = self.units[self._next]
            # Stage 3 launches on events every rank sees alike ([Note: stage-3 order]).
            done = u.backward_done if self.stage == 3 else u.complete
            if not (done or force):
                return
            if u.flat_grad is None:  # no parameter of this unit was used
                u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            u.flat_grad.div_(self.comm.world_size)  # gloo has no AVG
            # precision.communication_data_type: gradients travel (and are summed) in that
            # dtype, and land back in the fp32 shard in wait_gradients.
            send = u.flat_grad if self._wire in (None, u.dtype) else u.flat_grad.to(self._wire)
            u.reduced = torch.empty(u.shard_numel, dtype=send.dtype, device=u.device)
            u.reduce_handle = self.comm.reduce_scatter(u.reduced, send, async_op=True, tag=u.tag)
            self._next += 1

    def finish_gradients(self) -> None:
        self._launch(force=True)
        self._sync = False
        # [Note: unused parameters]: which parameters some rank used in this step.
        if self.comm.world_size > 1 and self.units:
            used = [float(i in u.used) for u in self.units for i in range(len(u.params))]
            self._usage = torch.tensor(used, dtype=torch.float32, device=self.units[0].device)
            self._usage_handle = self.comm.all_reduce(self._usage, op="max", async_op=True)

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

    def _used_by_any_rank(self) -> list[set[int]]:
        """Per unit, the parameters some rank used in this step ([Note: unused parameters])."""
        usage, handle = self._usage, self._usage_handle
        self._usage = self._usage_handle = None
        if usage is None or not self.comm.active:  # one rank, or the planner's meta run
            return [set(u.used) for u in self.units]
        handle.wait()  # type: ignore[union-attr]
        flags = iter(usage.tolist())
        return [{i for i in range(len(u.params)) if next(flags) > 0} for u in self.units]

    def local_gradients(self) -> list[torch.Tensor]:
        return [u.grad_view() for u in self.units]

    # -- the step ------------------------------------------------------------------------------

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.wait_gradients()
        for u, used in zip(self.units, self._used_by_any_rank(), strict=True):
            grad = u.grad_view()
            for i, a, b, piece in u.pieces:
                piece.grad = grad[a:b] if i in used else None
        optimizer.step()
        if self.stage == 3:
            for u in self.units:  # a buffer gathered before the step holds stale values
                self._free(u)
        else:
            handles = []
            for u in self.units:
                assert u.shard is not None and u.flat_param is not None
                handles.append(self.comm.all_gather(u.flat_param, u.shard.clone(),
                                                    async_op=True, tag=u.tag))
            for h in handles:
                h.wait()
        for u in self.units:
            u.grad_view().zero_()
            u.used.clear()
            for *_, piece in u.pieces:
                piece.grad = None
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

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Stage 3: every unit gathered while inside (entering and leaving are collective), so
        that any rank may run forwards alone, e.g. an evaluation on rank 0 under no_grad.
        Read-only: changes to parameters inside are not kept. Stages 1-2 hold whole
        parameters already: nothing to do."""
        if self.stage < 3 or self._held:
            yield
            return
        for u in self.units:
            self._ready(u)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            for u in self.units:
                self._free(u)

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
        if self._buffers is not None:
            self._buffers.close()
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


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward calls ``callback``: it runs once the
    gradients of all those inputs exist, that is once the unit's backward is over (as FSDP2's
    post-backward hook does)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)
