"""ZeRO-3's gathers: a unit's parameters are gathered just before its module runs, forward and
backward, and freed right after (see [Note: stage-3 order] in ``strategy.py``).

Each unit is in one :class:`~longboat.strategies.zero.flat.UnitState`: ``SHARDED`` (only this rank's
shard; its parameters point at empty tensors), ``GATHERING`` (an all-gather of the full flat
parameter is in flight: a prefetch) or ``UNSHARDED`` (the full flat parameter is here and its
parameters are views into it).

[Note: reused units] A module may run several times in one forward (weights shared across
layers, as ALBERT does). Each training call whose inputs need a gradient counts in ``calls`` and
passes its inputs through :class:`_PostBackward`; the unit's backward is over when the last of
those reports, and its gradient (accumulated over every use by autograd and the flat buffer) is
reduced once, then. A call whose inputs need no gradient (the model's first layer run on the
data, reused later) reports nothing: autograd may still be accumulating its use's gradient after
every other call's backward ended, so such a unit (``blind``) is done only when the whole
backward is, like the root.

[Note: parameter dtype] With ``precision.param_dtype`` (FSDP2's ``MixedPrecisionPolicy``,
DeepSpeed's bf16), a unit computes in that dtype (``FlatUnit.compute_dtype``) while its shard,
the masters, keeps the parameters' own, so the optimizer and its state step fp32 master shards:

- stage 3 gathers a unit in that dtype before each use: each rank casts its shard, and the
  all-gather moves half the bytes in bf16;
- stages 1-2 keep the whole unit in that dtype (the parameters are views of it, so the module
  computes from bf16 weights as DeepSpeed's bf16 model does) beside an fp32 shard of their own,
  and after each step cast the updated shard and all-gather it in bf16 (``step.py``), as
  DeepSpeed's ``all_gather_dp_groups`` gathers its ``bit16_groups_flat``.

Gradients arrive in bf16 and are reduced in ``precision.reduce_dtype``, else in bf16 (FSDP2's
default, DeepSpeed's ``communication_data_type`` default under bf16), and land in the shard's
own dtype: stages 2-3 sum each micro-batch's reduced shard into an fp32 gradient shard; stage 1
accumulates the step's micro-batches in its full fp32 gradient buffer and casts at the
reduce-scatter (one rank, sending nothing, does not cast). Clipping reads those fp32 shards.
Parameters of ``KEEP_OWN_DTYPE`` modules (``units.py``) stay in units of their own dtype, and
frozen parameters and buffers are not cast. What must see the masters (the full state dict, the
model handed back by ``close``, checkpoints) reads them in their own dtype (stage 3:
:meth:`Gathering.master`; stages 1-2: ``strategy.whole_masters``, and checkpoints save the
shards' pieces); a checkpoint loaded refills the masters and casts them into the bf16 copy.
``gathered_parameters()`` gives the parameters as the forward sees them.

DeepSpeed 0.19.8, read for this: ``bf16.enabled`` casts the module's parameters to bf16 and
keeps its buffers (``engine._configure_distributed_model``); ZeRO-1/2 keep an fp32 copy of each
rank's partition (``single_partition_of_fp32_groups`` in ``zero/stage_1_and_2.py``), step it and
all-gather the bf16 flat groups; ZeRO-3 keeps ``fp32_partitioned_groups_flat`` (``stage3.py``);
``communication_data_type`` defaults to bf16 (``engine.communication_data_type``). ZeRO-1 with
``data_types.grad_accum_dtype = 'fp32'`` uses ``BF16_Optimizer`` (``bf16_optimizer.py``), which
accumulates gradients in fp32 buffers, as stage 1 does here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from longboat.comm.protocol import Comm
from longboat.comm.trace import LONE_FORWARD
from longboat.config.errors import ConfigError
from longboat.strategies.zero.flat import FlatUnit, UnitState
from longboat.strategies.zero.storage import alloc_storage, empty, free_storage


class Removable(Protocol):
    """What :meth:`Gathering.install` returns: hooks and the like, each undone by ``remove``."""

    def remove(self) -> None: ...


class ParamHome(Protocol):
    """Where stage 3's parameter shards live between gathers (the part of a
    :class:`~longboat.strategies.zero.home.Home` gathers see)."""

    def bring_param(self, u: FlatUnit) -> None: ...

    def param_ready(self, u: FlatUnit) -> None: ...

    def drop_param(self, u: FlatUnit) -> None: ...


_F = TypeVar("_F", bound=Callable[..., Any])


def _between_graphs(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, keeping ``fn``'s type (torch's is unannotated)."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


class Gathering:
    """Gathers and frees stage-3 units around their modules' forward and backward.

    ``on_unit_done`` is called when a unit's backward is over (the strategy launches its
    reduce-scatter then); ``root`` is the model, whose unit stays gathered from the end of a
    training forward into the backward that follows at once (FSDP2 does not reshard its root
    after forward either).
    """

    def __init__(
        self,
        units: list[FlatUnit],
        comm: Comm,
        root: nn.Module,
        prefetch: bool,
        on_unit_done: Callable[[], None],
        home: ParamHome,
        record: Callable[[tuple[str, int]], None] | None = None,
    ) -> None:
        self.units = units
        # Told of each gather put on the wire ([Note: stage-3 shadow] in ``shadow.py``)
        self.record = record
        # Where the parameter shards live ([Note: homes] in ``homes.py``): on disk, read
        # before their gather and dropped after it ([Note: parameter offload])
        self.home = home
        self.comm = comm
        self.root = root
        self.prefetch = prefetch
        self.on_unit_done = on_unit_done
        self.held = False  # gathered_parameters(): every unit stays gathered
        # Inside a forward outside training, not held: its gathers' tags say so ([Note: lone
        # forwards] in ``comm/trace.py``), so one run on some ranks only fails at its first.
        self._lone = False
        self._order: list[FlatUnit] = []  # the first training forward's order of units
        self._recording = True

    def install(self) -> list[Removable]:
        """Forward hooks on every unit's module, and the check of the first training forward
        ([Note: units run forward] in ``zero/units.py``)."""
        hooks: list[Removable] = [_FirstForward(self.root, self._not_run)]
        by_module: dict[int, list[FlatUnit]] = {}
        for u in self.units:
            by_module.setdefault(id(u.module), []).append(u)
        for us in by_module.values():
            m = us[0].module
            assert m is not None
            hooks.append(
                m.register_forward_pre_hook(
                    lambda _m, args, kwargs, us=us: self._before_forward(us, args, kwargs),
                    with_kwargs=True,
                )
            )
            hooks.append(
                m.register_forward_hook(lambda _m, _a, out, us=us: self._after_forward(us, out))
            )
        return hooks

    def _not_run(self) -> list[FlatUnit]:
        """The units whose module did not run in the first training forward."""
        ran = {id(u) for u in self._order}
        return [u for u in self.units if id(u) not in ran and u.module is not self.root]

    # -- one unit ------------------------------------------------------------------------------

    def gather(self, u: FlatUnit, async_op: bool = False) -> None:
        """Start gathering ``u`` unless it is gathered or on its way."""
        if u.state is not UnitState.SHARDED:
            return
        assert u.shard is not None
        self.home.bring_param(u)
        one = self.comm.world_size == 1
        if one and u.compute_dtype is None:  # the shard is the whole unit: nothing to copy
            u.flat_param, u.state = u.shard, UnitState.UNSHARDED
            return  # read by the unit's forward: ready() waits for the shard
        self.home.param_ready(u)
        # [Note: storage resize]: the unit's own buffer, its memory given back for the gather
        # (never another unit's: views of it that autograd saved must see this unit's values)
        if u.full is None:
            u.full = empty(u.padded, u.gathered_dtype, u.device)
        else:
            alloc_storage(u.full)
        # [Note: parameter dtype]: the shard travels in the dtype the unit computes in.
        shard = u.shard if u.compute_dtype is None else u.shard.to(u.compute_dtype)
        if one:
            u.full.copy_(shard)
            u.flat_param, u.state = u.full, UnitState.UNSHARDED
            self.home.drop_param(u)
            return
        if self.record is not None:
            self.record(("gather", u.index))
        tag = f"{u.tag}, {LONE_FORWARD}" if self._lone else u.tag
        u.gather_handle = self.comm.all_gather(u.full, shard, async_op=async_op, tag=tag)
        u.flat_param, u.state = u.full, UnitState.GATHERING

    def ready(self, u: FlatUnit) -> None:
        """Make ``u``'s parameters usable: gather (or finish a prefetch) and point at it."""
        self.gather(u)
        self.home.param_ready(u)
        if u.state is UnitState.GATHERING:
            assert u.gather_handle is not None  # GATHERING: its all-gather is in flight
            u.gather_handle.wait()
            u.gather_handle = None
            u.state = UnitState.UNSHARDED
            self.home.drop_param(u)
        assert u.flat_param is not None
        u.point_params_at(u.flat_param)

    def free(self, u: FlatUnit) -> None:
        """Back to ``SHARDED`` (unless every unit is held)."""
        if self.held or u.state is UnitState.SHARDED:
            return
        if u.state is UnitState.GATHERING:  # a prefetch in flight must land before its buffer goes
            assert u.gather_handle is not None
            u.gather_handle.wait()
            u.gather_handle = None
            self.home.drop_param(u)
        u.release_params()
        if u.flat_param is not u.shard:
            free_storage(u.flat_param)  # type: ignore[arg-type]
        else:  # one rank: the shard itself was the gathered unit
            self.home.drop_param(u)
        u.flat_param, u.state = None, UnitState.SHARDED

    def free_all(self) -> None:
        for u in self.units:
            self.free(u)

    def master(self, u: FlatUnit) -> torch.Tensor:
        """``u``'s whole flat parameter in its shard's own dtype, gathered now (collective):
        the fp32 masters under [Note: parameter dtype]."""
        assert u.shard is not None
        self.home.bring_param(u)
        self.home.param_ready(u)
        if self.comm.world_size == 1:
            full = u.shard.clone()
        else:
            full = torch.empty(u.padded, dtype=u.dtype, device=u.device)
            self.comm.all_gather(full, u.shard, tag=u.tag)
        self.home.drop_param(u)
        return full

    @contextlib.contextmanager
    def masters(self) -> Iterator[None]:
        """Every parameter a view of its unit's master values while inside (entering is
        collective); nothing runs a forward inside."""
        self.free_all()
        for u in self.units:
            u.point_params_at(self.master(u))
        try:
            yield
        finally:
            for u in self.units:
                u.release_params()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Every unit gathered while inside (entering and leaving are collective)."""
        if self.held:
            yield
            return
        for u in self.units:
            self.ready(u)
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self.free_all()

    # -- around the modules --------------------------------------------------------------------

    def _prefetch(self, us: list[FlatUnit], step: int) -> None:
        if not self.prefetch or self._recording or not self._order:
            return
        anchor = us[-1] if step > 0 else us[0]
        if anchor not in self._order:  # a unit the first forward did not run
            return
        pos = self._order.index(anchor) + step
        if 0 <= pos < len(self._order):
            u = self._order[pos]
            if step < 0 and u.backward_done:
                return  # its backward is already over: gathering again would only waste memory
            self.gather(u, async_op=True)

    # Both forward hooks run as Python under torch.compile: dynamo would bind the unit's
    # parameters before the gather pointed them at it ([Note: compiling under a strategy]
    # in longboat/compile.py).
    @_between_graphs
    def _before_forward(
        self, us: list[FlatUnit], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # Only a training forward (as in [Note: buffers]) is followed by a backward on every
        # rank; another (an evaluation, maybe on one rank) must leave no trace that one rank has
        # and another has not.
        training = us[0].module.training and torch.is_grad_enabled()  # type: ignore[union-attr]
        self._lone = not training and not self.held
        try:
            for u in us:
                self.ready(u)
                if training and self._recording and u not in self._order:
                    self._order.append(u)
            self._prefetch(us, +1)
        finally:
            self._lone = False
        return self._watch_inputs(us, args, kwargs) if training else (args, kwargs)

    def _watch_inputs(
        self, us: list[FlatUnit], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pass the inputs that need a gradient through :class:`_PostBackward`, whose backward
        runs once the unit's backward is over ([Note: stage-3 order])."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            # e.g. the first unit: handled when the backward is over ([Note: reused units])
            for u in us:
                u.blind = True
            return args, kwargs
        for u in us:
            u.calls += 1
        # torch's Function.apply is unannotated
        watched: tuple[torch.Tensor, ...] = _PostBackward.apply(  # type: ignore[no-untyped-call]
            lambda: self._after_backward(us), *(flat[i] for i in where)
        )
        for i, t in zip(where, watched, strict=True):
            flat[i] = t
        out: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten(flat, spec)
        return out

    @_between_graphs
    def _after_forward(self, us: list[FlatUnit], out: Any) -> None:
        training = torch.is_grad_enabled() and us[0].module.training  # type: ignore[union-attr]
        if not (training and us[0].module is self.root):
            for u in us:
                self.free(u)
        if not torch.is_grad_enabled():
            return

        def before_backward(g: torch.Tensor) -> torch.Tensor:
            self._before_backward(us)
            return g

        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(before_backward)  # type: ignore[no-untyped-call]  # torch's is unannotated

    def _before_backward(self, us: list[FlatUnit]) -> None:
        self._recording = False  # the first forward fixed the order prefetching follows
        for u in us:
            self.ready(u)
        self._prefetch(us, -1)

    def _after_backward(self, us: list[FlatUnit]) -> None:
        for u in us:
            u.calls -= 1
            # The last of the module's calls in this forward ([Note: reused units])
            if u.calls == 0 and not u.blind:
                u.backward_done = True
                self.free(u)
        self.on_unit_done()

    def backward_over(self) -> None:
        """The whole backward returned: nothing needs a unit gathered."""
        for u in self.units:
            u.calls = 0
            u.blind = False
        self.free_all()


class _FirstForward:
    """Explains a failed first training forward in which some unit's module had not run: its
    parameters were never gathered ([Note: units run forward] in ``zero/units.py``).

    Hooks cannot do this: an error in a forward hook set to run after a failed forward becomes
    a warning. So the root's ``forward`` is wrapped (as an instance attribute, which keeps the
    model's names and state) until a training forward passed the check, then put back.
    """

    def __init__(self, root: nn.Module, not_run: Callable[[], list[FlatUnit]]) -> None:
        self.root = root
        self.not_run = not_run
        # A forward the instance already had (another library's wrapper) is kept and restored.
        self.own = root.__dict__.get("forward")
        self.inner = root.forward
        root.forward = self._forward

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.root.training and torch.is_grad_enabled()):
            return self.inner(*args, **kwargs)
        try:
            out = self.inner(*args, **kwargs)
        except ConfigError:
            raise  # already says what to change (a compile failure names its module, say)
        except Exception as e:
            missing = self.not_run()
            if missing:  # a parameter of shape [0] read somewhere inside torch, most likely
                raise ConfigError(_not_run_message(missing)) from e
            raise
        # A unit that did not run in a forward that worked is a module used on some steps only
        # (which all ranks skip alike); its parameters read directly would show as gradients of
        # the wrong size (``Zero._on_grad``).
        self.remove()
        return out

    def remove(self) -> None:
        if self.root.__dict__.get("forward") != self._forward:
            return
        if self.own is None:
            del self.root.forward
        else:
            self.root.forward = self.own


def _not_run_message(missing: list[FlatUnit]) -> str:
    named = ", ".join(f"{u.tag} ({type(u.module).__name__})" for u in missing[:4])
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    return (
        f"zero-3: the model's first training forward failed, and the module of {named}{more} "
        "had not run in it. A unit's parameters are gathered when its module's forward is "
        "called, so a module whose parameters another module reads directly cannot be a unit "
        f"({UNIT_FIX})"
    )


#: How to choose other units, for the errors that name a unit which cannot be one.
UNIT_FIX = (
    "set zero.unit_classes to the classes of modules whose forward runs, such as the model's "
    "repeated blocks, or set zero.unit_min_params higher"
)


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


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []
