"""ZeRO's optimizer step over the units' shards, whole or unit by unit."""

from __future__ import annotations

from collections.abc import Callable

import torch

from longboat.comm.protocol import Comm
from longboat.optim.checks import has_step_hooks, is_elementwise
from longboat.strategies.zero.flat import FlatUnit
from longboat.strategies.zero.home import Home


def step_units(
    optimizer: torch.optim.Optimizer,
    units: list[FlatUnit],
    home: Home,
    after: Callable[[FlatUnit], None],
    by_unit: bool,
) -> None:
    """Step every unit, then ``home.stepped(unit)`` and ``after(unit)``. Unit by unit where
    ``by_unit`` asks or the home needs it ([Note: homes] in ``homes.py``): every piece's
    gradient is set aside and each unit's given back for its own ``step()`` (an element-wise
    optimizer steps only pieces with a gradient), with the unit's state brought in around it;
    else one ``step()`` for all."""
    if not (by_unit or home.steps_by_unit):
        optimizer.step()
        for u in units:
            home.stepped(u, optimizer)
            after(u)
        return
    grads = {id(pc): pc.grad for u in units for *_, pc in u.pieces}
    for u in units:
        for *_, pc in u.pieces:
            pc.grad = None

    def step_unit(u: FlatUnit) -> None:
        for *_, pc in u.pieces:
            pc.grad = grads[id(pc)]
        optimizer.step()
        for *_, pc in u.pieces:
            pc.grad = None
        home.stepped(u, optimizer)
        after(u)

    home.step(optimizer, step_unit)


def step_and_gather(
    optimizer: torch.optim.Optimizer, units: list[FlatUnit], home: Home, comm: Comm
) -> None:
    """Stages 1-2: the updated shards are all-gathered into every rank's full flat
    parameters. An element-wise optimizer without step hooks steps unit by unit, each
    unit's all-gather starting while the next unit steps (as replicate's buckets do,
    [Note: optimizer overlap] in ``replicate.py``)."""
    if comm.world_size == 1:
        # [Note: a shard group of one] The shard is the whole flat parameter (a view of it, or
        # with param_dtype its fp32 masters): the step updates it in place, there is nothing to
        # gather and no gather to overlap with the next unit's step, so one step() for all
        # units, with no copy of the parameters. Unit by unit, each step() paid the optimizer's
        # fixed cost again: on an H200, ZeRO-2 of one rank spent 12.8 ms of host time per step
        # in 17 AdamW steps against plain PyTorch's 4.2 ms in one (gpu/step_time.json).
        step_units(optimizer, units, home, _to_compute_dtype, by_unit=False)
        return
    handles = []

    def gather(u: FlatUnit) -> None:
        assert u.shard is not None and u.flat_param is not None
        # [Note: parameter dtype] in gather.py: the masters travel in the dtype computed in
        shard = u.shard.clone() if u.compute_dtype is None else u.shard.to(u.compute_dtype)
        handles.append(comm.all_gather(u.flat_param, shard, async_op=True, tag=u.tag))

    # A home that steps by unit refused step hooks when it started.
    by_unit = is_elementwise(optimizer) and not has_step_hooks(optimizer)
    step_units(optimizer, units, home, gather, by_unit)
    for h in handles:
        h.wait()


def _to_compute_dtype(u: FlatUnit) -> None:
    """A shard group of one: with param_dtype, the updated masters into the parameters'
    low-precision flat buffer ([Note: parameter dtype] in ``gather.py``); else nothing, the
    flat parameter being the shard itself."""
    if u.compute_dtype is not None:
        assert u.shard is not None and u.flat_param is not None
        u.flat_param[: u.shard.numel()].copy_(u.shard)
