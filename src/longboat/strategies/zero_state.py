"""Checkpoint state of the ZeRO strategy (see [Note: pieces] in ``pieces.py``).

Each flat unit's shard ``[lo, hi)`` is cut along the parameters it overlaps: parameter ``i``
occupies ``[offsets[i], offsets[i] + numel)`` of the flat buffer, so this rank holds elements
``[max(lo, off) - off, min(hi, off + numel) - off)`` of it, and the same slice of every
element-wise optimizer state (the optimizer holds one flat state per unit shard). Padding at the
end of a unit belongs to no parameter and is never saved; it loads as zeros, as it started.
Buffers and frozen parameters stay whole on every rank and are saved once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from longboat.strategies.flat import FlatUnit
from longboat.strategies.pieces import (
    MODEL,
    OPTIM,
    Piece,
    PieceSource,
    RankState,
    canonical_names,
    decode_scalar,
    split_state,
)
from longboat.strategies.whole_state import load_model, model_pieces

if TYPE_CHECKING:
    from longboat.strategies.zero import Zero

log = logging.getLogger("longboat")


def _overlaps(u: FlatUnit) -> Iterator[tuple[int, int, int, int]]:
    """(parameter index, its offset, start, end) of every parameter this rank's shard touches;
    start/end are flat positions in the unit, within ``[lo, hi)``."""
    for i, (off, shape) in enumerate(zip(u.offsets, u.shapes, strict=True)):
        a, b = max(u.lo, off), min(u.hi, off + shape.numel())
        if a < b:
            yield i, off, a, b


def rank_state(zero: Zero, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
    """This rank's shards of every unit, cut into per-parameter pieces."""
    names = canonical_names(model)
    in_units = {id(p) for u in zero.units for p in u.params}
    state = RankState(pieces=model_pieces(model, in_units, replicated=True))
    for u in zero.units:
        assert u.shard is not None
        tensors, scalars = split_state(optimizer.state.get(u.shard, {}), u.shard_numel,
                                       u.device, f"flat unit {u.index}")
        for p in u.params:
            if scalars:
                state.scalars[names[id(p)]] = scalars
        shard = u.shard.detach()
        for i, off, a, b in _overlaps(u):
            name, shape = names[id(u.params[i])], tuple(u.shapes[i])
            lo, hi = a - u.lo, b - u.lo  # positions within the shard
            state.pieces.append(Piece(name, MODEL, shape, a - off, b - off, shard[lo:hi]))
            state.pieces += [Piece(name, key, shape, a - off, b - off, t.detach()[lo:hi])
                             for key, t in tensors.items()]
    state.groups = [[names[id(p)] for u in zero.units if u.group == g for p in u.params]
                    for g in range(len(optimizer.param_groups))]
    return state


@torch.no_grad()
def load(zero: Zero, model: nn.Module, optimizer: torch.optim.Optimizer,
         source: PieceSource) -> None:
    """Fill this rank's shards (and, stages 1-2, the whole flat parameters) from ``source``."""
    names = canonical_names(model)
    load_model(model, source, {id(p) for u in zero.units for p in u.params})
    for u in zero.units:
        assert u.shard is not None
        if zero.stage == 3:
            zero._free(u)  # a buffer gathered earlier would be stale after this
            for i, off, a, b in _overlaps(u):
                source.read(names[id(u.params[i])], MODEL, a - off, b - off,
                            u.shard.data[a - u.lo: b - u.lo])
        else:
            # Every rank keeps the whole flat parameter (the shard is a view into it).
            assert u.flat_param is not None
            for i, (off, shape) in enumerate(zip(u.offsets, u.shapes, strict=True)):
                n = shape.numel()
                source.read(names[id(u.params[i])], MODEL, 0, n, u.flat_param[off: off + n])
        _load_optimizer_state(u, optimizer, [names[id(p)] for p in u.params], source)


def _load_optimizer_state(u: FlatUnit, optimizer: torch.optim.Optimizer, names: list[str],
                          source: PieceSource) -> None:
    assert u.shard is not None
    keys = sorted({k for n in names for k in source.state_keys(n)})
    scalars = _unit_scalars(u, names, source)
    if not keys and not scalars:
        optimizer.state.pop(u.shard, None)  # nothing saved: as a fresh optimizer would be
        return
    st: dict[str, Any] = {}
    for key in keys:
        t = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)
        for i, off, a, b in _overlaps(u):
            if key in source.state_keys(names[i]):  # else: never stepped, zeros as if fresh
                source.read(names[i], key, a - off, b - off, t[a - u.lo: b - u.lo])
        st[key.removeprefix(OPTIM)] = t
    for k, v in scalars.items():
        st[k] = decode_scalar(v, u.device)
    optimizer.state[u.shard] = st


def _unit_scalars(u: FlatUnit, names: list[str], source: PieceSource) -> dict[str, Any]:
    """One set of optimizer scalars for a unit, from its parameters' saved ones.

    They agree unless the checkpoint came from a strategy that skips parameters without a
    gradient (a parameter unused in some steps has a smaller ``step``): the unit takes the
    largest, and says so.
    """
    out: dict[str, Any] = {}
    for n in names:
        for k, v in source.scalars(n).items():
            if k not in out:
                out[k] = v
            elif v != out[k]:
                if _num(v) is not None and (_num(out[k]) is None or _num(v) > _num(out[k])):
                    out[k] = v
                log.warning("flat unit %d: optimizer state %r differs between its parameters "
                            "in the checkpoint (e.g. %r); the unit uses %r", u.index, k, n,
                            _num(out[k]))
    return out


def _num(encoded: Any) -> Any:
    return encoded["value"] if isinstance(encoded, dict) else encoded
