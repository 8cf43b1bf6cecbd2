"""Checkpoint state of the ZeRO strategy (see [Note: pieces] in ``pieces.py``).

Each flat unit's shard ``[lo, hi)`` holds one piece of every parameter it overlaps
([Note: shard pieces] in ``flat.py``): parameter ``i`` occupies ``[offsets[i], offsets[i] +
numel)`` of the flat buffer, so this rank holds elements ``[max(lo, off) - off, min(hi, off +
numel) - off)`` of it, and the optimizer keeps that piece's state (element-wise tensors of the
piece's size, scalars such as ``step`` per parameter). Padding at the end of a unit belongs to no
parameter and is never saved; it loads as zeros, as it started. Buffers and frozen parameters stay
whole on every rank and are saved once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.pieces import (
    MODEL,
    OPTIM,
    Piece,
    PieceSource,
    RankState,
    canonical_names,
    decode_scalar,
    members,
    split_state,
)
from longboat.strategies.whole_state import load_model, model_pieces
from longboat.strategies.zero.flat import FlatUnit, UnitState


def rank_state(
    units: list[FlatUnit],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dp: Comm,
    replicas: Comm,
) -> RankState:
    """This rank's pieces of every unit, with the optimizer state of each. Buffers and frozen
    parameters are alike on every rank of ``dp``; shard pieces on the ranks of ``replicas``
    ([Note: hybrid sharding] in ``strategy.py``; just this rank without replicas)."""
    names = canonical_names(model)
    in_units = {id(p) for u in units for p in u.params}
    state = RankState(pieces=model_pieces(model, in_units, members(dp)))
    shards_alike = members(replicas)
    for u in units:
        for i, a, b, piece in u.pieces:
            name, shape = names[id(u.params[i])], tuple(u.shapes[i])
            start, end = u.lo + a - u.offsets[i], u.lo + b - u.offsets[i]  # within the parameter
            tensors, scalars = split_state(
                optimizer.state.get(piece, {}), b - a, u.device, f"parameter {name!r}"
            )
            state.pieces.append(Piece(name, MODEL, shape, start, end, piece.detach(), shards_alike))
            state.pieces += [
                Piece(name, key, shape, start, end, t.detach(), shards_alike)
                for key, t in tensors.items()
            ]
            if scalars:
                state.scalars[name] = scalars
    state.groups = [
        [names[id(p)] for u in units if u.group == g for p in u.params]
        for g in range(len(optimizer.param_groups))
    ]
    return state


@torch.no_grad()
def load(
    units: list[FlatUnit], model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
) -> None:
    """Fill this rank's shards (and, where the full flat parameters persist: stages 1-2, those
    too) from ``source``. Sharded units (stage 3) must be freed first."""
    names = canonical_names(model)
    load_model(model, source, {id(p) for u in units for p in u.params})
    for u in units:
        assert u.shard is not None
        if u.state is UnitState.SHARDED:
            for i, a, b, piece in u.pieces:
                start = u.lo + a - u.offsets[i]
                source.read(names[id(u.params[i])], MODEL, start, start + b - a, piece.data)
        else:
            # Every rank keeps the whole flat parameter (the shard is a view into it, or under
            # [Note: parameter dtype] the masters' own copy: both filled from the saved masters).
            assert u.flat_param is not None
            full = u.flat_param
            if u.compute_dtype is not None:
                full = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
            for i, (off, shape) in enumerate(zip(u.offsets, u.shapes, strict=True)):
                n = shape.numel()
                source.read(names[id(u.params[i])], MODEL, 0, n, full[off : off + n])
            if full is not u.flat_param:
                u.shard.copy_(full[u.lo : u.hi])
                u.flat_param.copy_(full)
        for i, a, b, piece in u.pieces:
            _load_optimizer_state(u, i, a, b, piece, optimizer, names[id(u.params[i])], source)


def _load_optimizer_state(
    u: FlatUnit,
    i: int,
    a: int,
    b: int,
    piece: nn.Parameter,
    optimizer: torch.optim.Optimizer,
    name: str,
    source: PieceSource,
) -> None:
    keys, scalars = source.state_keys(name), source.scalars(name)
    if not keys and not scalars:
        optimizer.state.pop(piece, None)  # nothing saved: as a fresh optimizer would be
        return
    start = u.lo + a - u.offsets[i]
    st: dict[str, Any] = {}
    for key in keys:
        t = torch.empty(b - a, dtype=u.dtype, device=u.device)
        source.read(name, key, start, start + b - a, t)
        st[key.removeprefix(OPTIM)] = t
    for k, v in scalars.items():
        st[k] = decode_scalar(v, u.device)
    optimizer.state[piece] = st
