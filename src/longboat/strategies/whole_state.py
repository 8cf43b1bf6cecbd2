"""Checkpoint state of tensors every rank holds whole (see [Note: pieces] in ``pieces.py``).

``single`` and ``replicate`` hold everything whole; ZeRO holds buffers and frozen parameters whole
and uses :func:`model_pieces`/:func:`load_model` for those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from longboat.observe.memory import model_state, optimizer_state_tensors
from longboat.pieces import (
    MODEL,
    OPTIM,
    Piece,
    PieceSource,
    RankState,
    canonical_names,
    decode_scalar,
    split_state,
)


def _model_tensors(model: nn.Module, skip: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``state_dict`` entries (parameters and persistent buffers), each tensor once."""
    seen = set(skip)
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"model state {name!r} is a {type(t).__name__} (a module's extra "
                "state), which checkpoints cannot hold without pickle"
            )
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def model_pieces(model: nn.Module, skip: set[int], replicas: tuple[int, ...]) -> list[Piece]:
    """Whole pieces of every parameter and buffer except those whose id is in ``skip``, held
    alike by the global ranks ``replicas``."""
    return [
        Piece(name, MODEL, tuple(t.shape), 0, t.numel(), t.detach().reshape(-1), replicas)
        for name, t in _model_tensors(model, skip)
    ]


def _read_into(source: PieceSource, name: str, key: str, t: torch.Tensor) -> None:
    if t.is_contiguous():
        source.read(name, key, 0, t.numel(), t.view(-1))
    else:
        flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        source.read(name, key, 0, t.numel(), flat)
        t.copy_(flat.view(t.shape))


@torch.no_grad()
def load_model(model: nn.Module, source: PieceSource, skip: set[int]) -> None:
    """Fill every parameter and buffer except those in ``skip`` from ``source``."""
    for name, t in _model_tensors(model, skip):
        _read_into(source, name, MODEL, t.data)


def whole_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, replicas: tuple[int, ...] = ()
) -> RankState:
    """The state of a strategy that holds every tensor whole, alike on the global ranks
    ``replicas``."""
    names = canonical_names(model)
    state = RankState(pieces=model_pieces(model, set(), replicas))
    for group in optimizer.param_groups:
        state.groups.append([_name(names, p) for p in group["params"]])
        for p in group["params"]:
            name = names[id(p)]
            tensors, scalars = split_state(
                optimizer.state.get(p, {}), p.numel(), p.device, f"parameter {name!r}"
            )
            state.pieces += [
                Piece(name, key, tuple(p.shape), 0, p.numel(), t.detach().reshape(-1), replicas)
                for key, t in tensors.items()
            ]
            if scalars:
                state.scalars[name] = scalars
    return state


@torch.no_grad()
def load_whole_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
) -> None:
    """Fill a whole-tensor strategy's model and optimizer state from ``source``."""
    load_model(model, source, set())
    names = canonical_names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _name(names, p)
            keys, scalars = source.state_keys(name), source.scalars(name)
            if not keys and not scalars:
                optimizer.state.pop(p, None)  # nothing saved: as a fresh optimizer would be
                continue
            st: dict[str, object] = {}
            for key in keys:
                # Every element is read: a checkpoint's shards cover each tensor whole.
                t = torch.empty_like(p, memory_format=torch.contiguous_format)
                source.read(name, key, 0, p.numel(), t.view(-1))
                st[key.removeprefix(OPTIM)] = t
            for k, v in scalars.items():
                st[k] = decode_scalar(v, p.device)
            optimizer.state[p] = st


def _name(names: dict[int, str], p: torch.Tensor) -> str:
    if id(p) not in names:
        raise ValueError(
            f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not "
            "a parameter of the model; a checkpoint names optimizer state by "
            "parameter name, so build the optimizer from model.parameters()"
        )
    return names[id(p)]


def whole_model_state(a: int, k: int, optimizer_here: bool = True) -> dict[str, int]:
    """[Note: memory formulas] (``observe/memory.py``) for a rank that holds the whole model:
    ``a`` fp32 parameters, their gradients, and ``k`` bytes of optimizer state per parameter
    where this rank steps the optimizer."""
    return model_state(4 * a, 4 * a, k * a if optimizer_here else 0)


class WholeModel:
    """What a strategy whose every rank holds the whole model (single, replicate, a parameter
    server's worker) answers alike; ``params`` are its trainable parameters."""

    params: list[nn.Parameter]

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        return {
            "parameters": list(self.params),
            "gradients": [p.grad for p in self.params if p.grad is not None],
            "optimizer_state": optimizer_state_tensors(optimizer),
        }

    def gathered_parameters(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # parameters are whole on every rank

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()
