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
:class:`~longboat.strategies.zero.policy.ZeroPolicy`. Beside the class: the units' reductions in
``reduce.py`` ([Note: unused parameters], [Note: compressed ZeRO]), stage 3's gathers in
``gather.py``, where the units' state lives in ``homes.py`` ([Note: homes]: memory or disk),
the optimizer step in ``step.py`` and a joined rank's replay in ``shadow.py`` ([Note: stage-3
shadow]).

[Note: stage-3 order] Stage 3 mixes two kinds of collective during backward: the gathers of the
units still to run and the reduce-scatters of those done. Collectives are matched by order, so
both must be issued at events every rank sees alike, never at "this rank has all of the unit's
gradients", which differs between ranks when a parameter is used on some ranks only (a routed
expert inside a unit). Gathers happen when a unit's outputs receive their gradients (before its
backward); a unit's backward is over when the gradients of its inputs exist, which an identity
on the inputs reports (``gather._PostBackward``, as FSDP2's post-backward hook); its
reduce-scatter is launched then, or, for a unit whose inputs need no gradient (the first, the
root), once the whole backward returned. Each rank must run the same units in the same order: a
unit whose module runs on some ranks only (a routed expert as a unit of its own) cannot be
gathered by the others, and the desync check names it (each gather and reduce-scatter carries its
unit's tag); put such modules inside a unit that always runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from longboat.comm import compression
from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.grads import HeldGradients
from longboat.mesh import Axis
from longboat.observe.memory import optimizer_state_tensors
from longboat.pieces import PieceSource, RankState
from longboat.placement import planning_for_accelerator
from longboat.strategies.base import StrategyContext, StrategyDefaults
from longboat.strategies.buffers import BufferSync
from longboat.strategies.zero import homes
from longboat.strategies.zero import state as zero_state
from longboat.strategies.zero.flat import FlatUnit, UnitState, element_size
from longboat.strategies.zero.gather import Gathering, Removable
from longboat.strategies.zero.home import Home
from longboat.strategies.zero.in_memory import InMemory
from longboat.strategies.zero.init import DeferredInit
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.strategies.zero.reduce import Reduction
from longboat.strategies.zero.shadow import Shadow
from longboat.strategies.zero.step import step_and_gather, step_units
from longboat.strategies.zero.storage import empty, free_storage
from longboat.strategies.zero.units import LowParams, make_units, plan_units, stepped_params
from longboat.topology import Topology
from longboat.world import World


class Zero(StrategyDefaults):
    """ZeRO stages 1-3 behind the :class:`~longboat.strategies.base.Strategy` protocol."""

    name = "zero"
    can_shadow = True  # [Note: stage-3 shadow] in shadow.py

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
        self._gathering: Gathering | None = None  # stage 3
        self._buffers: BufferSync | None = None
        self._shadow = Shadow(self.policy.shard_params)  # [Note: stage-3 shadow]
        self.compressor = compression.build(ctx.compression)  # [Note: compressed ZeRO]
        self.home: Home = InMemory(ctx, self.policy)  # [Note: homes], set up below
        self._reduction = self._reducing()
        self._whole = False  # keep_steps_whole(): in-job recovery over the replica axis

    def _reducing(self) -> Reduction:
        """The units' reductions, landing where the home keeps gradients."""
        args = (self.units, self.where, self.home, self.compressor, self._shadow.record)
        return Reduction(self.ctx, self.policy, *args)

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # An optimizer that is not element-wise is refused by the engine ([Note: compositions]).
        if optimizer.state:
            raise ConfigError(
                "strategy 'zero' needs a fresh optimizer (it re-targets the "
                "optimizer at flat shards); build it before stepping it"
            )
        # [Note: deferred init]: the engine let only stage 3 have parameters on the meta device
        group_of, params = stepped_params(model, optimizer)
        made = DeferredInit(
            model,
            self.dp,
            self.control,
            self.ctx.param_init_fn,
            self.cfg.init_method,
            self.ctx.compute_device,
            placing=params if self.places_parameters else None,
        )
        with torch.no_grad():  # [Note: deferred init], [Note: placing parameters]: unit by unit
            for t in [*model.parameters(), *model.buffers()]:
                if not t.is_meta and not made.places(t):
                    self.dp.broadcast(t.data, src=0)
        self._buffers = BufferSync(model, self.dp)
        by_module = self.policy.units_by_module
        low = LowParams.of(self.ctx.param_dtype, model)  # [Note: parameter dtype]
        pieces = plan_units(model, params, group_of, self.cfg, by_module, self.ctx.isolated, low)
        self.home = homes.build(self.ctx, self.policy, model, params)
        units = make_units(
            model,
            pieces,
            group_of,
            self.comm,
            self.policy,
            made,
            self.home.adopt,
            low,
        )
        self.units += units
        self.where.update({id(p): (u, i) for u in units for i, p in enumerate(u.params)})
        self._reduction = self._reducing()
        for g, grp in enumerate(optimizer.param_groups):
            grp["params"] = [pc for u in self.units if u.group == g for *_, pc in u.pieces]
        for p in params:
            # torch's register_post_accumulate_grad_hook is unannotated
            hook = p.register_post_accumulate_grad_hook(self._reduction.on_grad)  # type: ignore[no-untyped-call]
            self._hooks.append(hook)
        made.finish()
        self.home.start(optimizer)
        if self.policy.shard_params:
            self._gathering = Gathering(
                self.units,
                self.comm,
                model,
                self.cfg.prefetch,
                lambda: self._reduction.order.advance(self._reduction.unit_done),
                home=self.home,
                record=self._shadow.record,
            )
            self._hooks += self._gathering.install()
        return model

    @property
    def offloaded(self) -> dict[str, int] | None:
        """With offload to disk: bytes on disk, and bytes read and written so far (``moved``:
        both)."""
        return self.home.offloaded

    @property
    def places_parameters(self) -> bool:  # [Note: placing parameters] in init.py
        host = self.cfg.offload_param.device == self.cfg.offload_optimizer.device == "cpu"
        beside = self.ctx.compute_device.type != "cpu" or planning_for_accelerator()
        return self.policy.shard_params and host and beside

    @property
    def deferred_init(self) -> bool:
        """Whether a model on the meta device can be made here ([Note: deferred init])."""
        return self.policy.shard_params

    @property
    def on_disk(self) -> dict[str, int]:
        """Bytes of model state this rank keeps on disk, per category."""
        return self.home.on_disk

    @property
    def on_host(self) -> dict[str, int]:
        """Bytes of model state this rank keeps in host memory beside an accelerator."""
        return self.home.on_host

    def held_gradients(self) -> HeldGradients | None:
        """Gradients kept out of memory ([Note: parameter offload]): the engine's clipping
        asks them for their sum of squares and hands them its factor."""
        return self.home.held_gradients()

    # -- gradients -----------------------------------------------------------------------------

    def before_forward(self) -> None:
        self._shadow.start()  # [Note: stage-3 shadow]: a new micro-batch's record

    def before_backward(self, sync: bool) -> None:
        if self._gathering is not None and self._gathering.held:
            raise RuntimeError(
                "engine.backward() inside engine.gathered_parameters(): that "
                "context is for evaluation; leave it (on every rank) to train"
            )
        self.wait_gradients()  # stages 2-3: the last micro-batch's reductions land in the shard
        self._reduction.before_backward(sync)

    def after_backward(self) -> None:
        self._reduction.after_backward()
        self._shadow.keep()  # [Note: stage-3 shadow]
        assert self._buffers is not None
        self._buffers.after_backward()
        if self._gathering is not None:
            self._gathering.backward_over()

    def shadow(self) -> None:
        """[Note: joining] in join.py. Stages 1-2: ``after_backward`` launches every unit (zeros,
        or what earlier micro-batches of the step accumulated); stage 3 also replays the
        gathers ([Note: stage-3 shadow] in ``shadow.py``)."""
        assert self._buffers is not None
        self._buffers.shadow()
        if self._gathering is not None:
            order = self._reduction.order
            self._shadow.replay(self.units, self._gathering, order, self.dp.rank)

    def buffers_from(self, rank: int) -> None:
        assert self._buffers is not None
        self._buffers.source = rank

    def finish_gradients(self) -> None:
        self._reduction.finish()

    def wait_gradients(self) -> None:
        self._reduction.wait()

    def norm_groups(self) -> list[Comm]:
        return [self.comm]  # shards are disjoint within the shard group, equal across replicas

    def local_gradients(self) -> list[torch.Tensor]:
        return self.home.local_gradients()  # on disk: none (see held_gradients)

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
        used_by_any = self._reduction.used_by_any_rank()
        if self._whole and self.comm.world_size > 1:
            # [Note: whole steps of a shard group]: no shard moves unless all of them will
            self.ctx.topology.control("dp_shard").barrier()
        for u, used in zip(self.units, used_by_any, strict=True):
            views = self.home.grad_pieces(u)
            for (i, *_, piece), g in zip(u.pieces, views, strict=True):
                piece.grad = g if i in used else None
        if self._gathering is not None:
            self._gathering.free_all()  # a buffer gathered before the step holds stale values
            step_units(optimizer, self.units, self.home, lambda u: None, by_unit=False)
        else:
            step_and_gather(optimizer, self.units, self.home, self.comm)
        self.home.step_over()
        for u in self.units:
            u.shard_empty = True
            u.used.clear()
            for *_, piece in u.pieces:
                piece.grad = None
            if not self.policy.shard_grads:
                assert u.flat_grad is not None
                u.flat_grad.zero_()
        if self.compressor is not None:
            self.compressor.step_done()  # the warm-up counts optimizer steps

    # -- in-job recovery over the replica axis ------------------------------------------------

    def replica_ranks(self) -> int:
        """The shard group holds one replica together ([Note: hybrid sharding])."""
        return self.comm.world_size

    def replica_axis(self) -> Axis:
        return "dp_replicate"  # the same shards, at the same place of every replica

    def replica_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """Each unit's shard (the masters), and its whole flat parameter where one is kept
        between steps (stages 1-2: the shard is a view of it, or, under [Note: parameter
        dtype], its source); the model's buffers."""
        if self._gathering is not None:
            self._gathering.free_all()  # every unit sharded, as between steps
        units = [t for u in self.units for t in (u.shard, u.flat_param) if t is not None]
        return [*units, *model.buffers()]

    def keep_steps_whole(self) -> None:
        """Note [whole steps of a shard group]: in-job recovery redoes a failed step, which is
        exact only if no shard moved in it. The replicas' average completes on some ranks of
        a shard group and fails on others (each all-reduces with its own peers in the other
        replicas, and only some of those may be lost); a rank whose average arrived would step
        its shard while the rest of its group redoes the step. So each shard group meets once
        more (a barrier, on the control plane) after every reduction arrived and before any
        shard steps: a rank passes it only when every rank of its group holds the step's
        gradients, and none is then left to fail before the step."""
        self._whole = True

    def regroup(self, topology: Topology, world: World) -> None:
        """Go on over ``topology`` after in-job recovery ([Note: in-job recovery] in
        ``longboat/recovery/__init__.py``): whole replicas stay, so this rank's shard group
        has the same size and its place in it ([Note: membership] in
        ``recovery/membership.py``); its shards stay as they are. The failed step's
        gradients and the reductions in flight on the old groups are dropped."""
        assert topology.mesh.dp_shard == self.comm.world_size, (topology.mesh, self.comm)
        self.ctx = dataclasses.replace(self.ctx, world=world, topology=topology)
        self.dp, self.comm = topology.data("dp"), topology.data("dp_shard")
        self.replicas, self.control = topology.data("dp_replicate"), topology.control("dp")
        assert self._buffers is not None
        self._buffers.comm = self.dp
        if self._gathering is not None:
            self._gathering.comm = self.comm
            self._gathering.free_all()
        for u in self.units:
            u.arrived.clear()
            u.used.clear()
            u.reduced = u.reduce_handle = None
            u.shard_empty = True
            if self.policy.shard_grads:
                u.flat_grad = None  # stages 2-3: a transient buffer per backward
            for g in (u.flat_grad, u.grad_shard):
                if g is not None:
                    g.zero_()
        self._reduction.regroup(topology)

    # -- state ---------------------------------------------------------------------------------

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = [u.shard for u in self.units if u.shard is not None]
        params += [u.flat_param for u in self.units if u.flat_param is not None]
        grads = [t for u in self.units for t in (u.flat_grad, u.grad_shard) if t is not None]
        comm = [u.reduced for u in self.units if u.reduced is not None]
        return {
            "parameters": params,
            "gradients": grads,
            # beside an accelerator the state is in host memory: the report's own row
            "optimizer_state": [] if self.home.on_host else optimizer_state_tensors(optimizer),
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
        """The model's ``state_dict`` with every parameter whole (gathered for stage 3, in the
        masters' dtype under [Note: parameter dtype])."""
        g = self._gathering
        low = any(u.compute_dtype for u in self.units)
        inside: contextlib.AbstractContextManager[None]
        if g is None:
            inside = self._masters() if low else contextlib.nullcontext()
        else:
            inside = g.masters() if low else self.gathered_parameters()
        with inside:
            return {k: v.detach().clone() for k, v in model.state_dict().items()}

    @contextlib.contextmanager
    def _masters(self) -> Iterator[None]:
        """Stages 1-2 under [Note: parameter dtype]: while inside, the parameters of every unit
        computed in a lower dtype are views of its masters, all-gathered on entering
        (collective)."""
        low = [u for u in self.units if u.compute_dtype is not None]
        for u in low:
            u.point_params_at(whole_masters(u, self.comm))
        try:
            yield
        finally:
            for u in low:
                assert u.flat_param is not None
                u.point_params_at(u.flat_param)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        if self._gathering is not None:
            self._gathering.free_all()  # every unit sharded, as between steps
        with self.home.reading(optimizer) as own:
            return own(zero_state.rank_state(self.units, model, optimizer, self.dp, self.replicas))

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        if self._gathering is not None:
            self._gathering.free_all()  # a buffer gathered earlier would be stale after this
        with self.home.loading(optimizer):
            zero_state.load(self.units, model, optimizer, source)

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """[Note: memory formulas] for this stage; optimizer state offloaded to disk or to host
        memory is not beside the parameters."""
        n = self.comm.world_size
        out = self.policy.model_state(a, n, k)
        low = [u for u in self.units if u.compute_dtype is not None]
        if low and not self.policy.shard_params:
            # [Note: parameter dtype]: a cast unit keeps the whole unit in the compute dtype
            # and its fp32 shard, for the 4 bytes per parameter of the formula
            cast = sum(u.numel for u in low)
            size = element_size(low[0].gathered_dtype)
            out["parameters"] += int(cast * (size - 4) + 4 * cast / n)
        for category in (*self.on_disk, *self.on_host):
            if category in out:
                out[category] = 0
        return out

    def close(self) -> None:
        self._release_hooks()
        if self._gathering is None:  # stages 1-2: the masters, not the copy computed from
            for u in self.units:
                if u.compute_dtype is not None:
                    full = whole_masters(u, self.comm)
                    for i, p in enumerate(u.params):
                        p.data = u.view(full, i).clone()
        if self._gathering is not None:  # hand the user back an ordinary model
            to = self.home.hands_back_to  # where the home keeps parameters, if not beside
            for u in self.units:
                if u.compute_dtype is None:
                    self._gathering.ready(u)
                    flat = u.flat_param
                else:  # the masters, not the copy computed from ([Note: parameter dtype])
                    self._gathering.free(u)
                    flat = self._gathering.master(u)
                for i, p in enumerate(u.params):
                    view = u.view(flat, i)  # type: ignore[arg-type]
                    p.data = view.clone() if to is None else view.to(to, copy=True)
                u.flat_param, u.state = None, UnitState.SHARDED
                if u.full is not None:
                    free_storage(u.full)
                if to is not None:  # one unit on the device at a time
                    self.home.drop_param(u)
        self.home.close()  # after the gathers above, which read its files

    def leave(self) -> None:
        """No model handed back: the gathers of close() are collectives, and at exit the ranks
        may be closing different engines ([Note: leaving at exit] in ``engine/core.py``)."""
        self._release_hooks()
        self.home.close()

    def _release_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._buffers is not None:
            self._buffers.close()


def whole_masters(u: FlatUnit, comm: Comm) -> torch.Tensor:
    """Stages 1-2: ``u``'s whole flat parameter in its masters' dtype, all-gathered from every
    rank's shard now (collective; [Note: parameter dtype] in ``gather.py``)."""
    assert u.shard is not None
    if comm.world_size == 1:
        return u.shard.clone()
    full = empty(u.padded, u.dtype, u.device)
    comm.all_gather(full, u.shard, tag=u.tag)
    return full
