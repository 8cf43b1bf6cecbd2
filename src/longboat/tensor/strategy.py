"""A data-parallel strategy over a tensor-parallel model: the strategy runs on this rank's parts
of the parameters as if they were the model, and this wrapper turns what it reports back into
the full model's terms.

* **Gradient norm.** Divided parameters' gradients are disjoint parts across the ``tp`` ranks:
  their squares are summed over the ``tp`` group too. The gradients of parameters every ``tp``
  rank holds whole are alike on each: only ``tp`` rank 0 counts them.
* **Checkpoints.** A piece of a divided parameter gets the parameter's full shape and the
  :class:`~longboat.pieces.Slices` it counts in; a piece of a whole one is held by
  the ``tp`` peers alike, so it is written once for all of them. Loading reads each divided
  parameter's slices, so any layout loads into any other.
* **Whole state.** ``full_state_dict`` gathers the divided tensors over ``tp``.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.pieces import PieceSource, RankState, Slices
from longboat.strategies.base import Strategy, StrategyDefaults
from longboat.tensor.parallel import TensorParallel


def wrap(strategy: Strategy, tensor: TensorParallel, global_rank: int) -> Strategy:
    """``strategy`` over the ``dp`` axis of ``tensor``'s model, reporting in the full model's
    terms (``strategy`` itself when nothing is divided)."""
    return TensorParallelStrategy(strategy, tensor, global_rank) if tensor.active else strategy


class TensorParallelStrategy(StrategyDefaults):
    """``inner`` (replicate, ZeRO, ...) over the ``dp`` axis of a tensor-parallel model.

    Of what a strategy may support (:class:`StrategyDefaults`), it passes on the inner
    strategy's memory formula and what it keeps on disk (per rank, over the rank's slices);
    the inner strategy's monitor columns are not yet in the full model's terms, and joining is
    refused.
    """

    def __init__(self, inner: Strategy, tensor: TensorParallel, global_rank: int) -> None:
        self.inner = inner
        self.tensor = tensor
        self.name = inner.name
        self._rank = global_rank

    # -- delegated as they are -----------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        return self.inner.setup(model, optimizer)

    def discard(self) -> None:
        self.inner.discard()

    @property
    def places_parameters(self) -> bool:
        return self.inner.places_parameters

    def before_forward(self) -> None:
        self.inner.before_forward()

    def hooked_modules(self) -> list[nn.Module]:
        """The modules the inner strategy hooks (``longboat/compile.py``)."""
        return self.inner.hooked_modules()

    def before_backward(self, sync: bool) -> None:
        self.inner.before_backward(sync)

    def after_backward(self) -> None:
        self.inner.after_backward()

    def finish_gradients(self) -> None:
        self.inner.finish_gradients()

    def wait_gradients(self) -> None:
        self.inner.wait_gradients()

    def local_gradients(self) -> list[torch.Tensor]:
        return self.inner.local_gradients()

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        return self.inner.tied_gradient(param)

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.inner.gradient_share(param)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.optimizer_step(optimizer)

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """The inner strategy's formula over this rank's parameters (its slices of the divided
        layers), and what it keeps on disk: the memory report and the plan see the strategy."""
        return self.inner.expected_memory(a, k)

    @property
    def on_disk(self) -> dict[str, int]:
        return self.inner.on_disk

    @property
    def on_host(self) -> dict[str, int]:
        return self.inner.on_host

    @property
    def offloaded(self) -> dict[str, int] | None:
        return self.inner.offloaded

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        return self.inner.memory_tensors(optimizer)

    def buffers_from(self, rank: int) -> None:
        self.inner.buffers_from(rank)

    def gathered_parameters(self) -> AbstractContextManager[None]:
        # Whole over dp; still this rank's tensor-parallel part, whose forward needs its peers.
        return self.inner.gathered_parameters()

    def close(self) -> None:
        self.inner.close()

    def leave(self) -> None:
        self.inner.leave()

    # -- in the full model's terms -------------------------------------------------------------

    def norm_groups(self) -> list[Comm]:
        return [*self.inner.norm_groups(), self.tensor.comm]

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = self.inner.full_state_dict(model)
        return {
            k: self.tensor.whole(k, v) if k in self.tensor.divided else v for k, v in state.items()
        }

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        state = self.inner.checkpoint_state(model, optimizer)
        peers = self._tp_peers
        pieces = []
        for p in state.pieces:
            d = self.tensor.divided.get(p.name)
            if d is not None:
                pieces.append(
                    dataclasses.replace(p, shape=d.shape, slices=self.tensor.slices(p.name))
                )
            else:  # whole on every tp rank: the same piece as the tp peers hold
                holders = p.replicas or (self._rank,)
                wide = sorted({q for r in holders for q in peers(r)})
                pieces.append(dataclasses.replace(p, replicas=tuple(wide)))
        return dataclasses.replace(state, pieces=pieces)

    def _tp_peers(self, rank: int) -> list[int]:
        # tp is the mesh's innermost axis: a rank's tp group is the block of tp ranks around it.
        size = self.tensor.comm.world_size
        first = rank - rank % size
        return list(range(first, first + size))

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        self.inner.load_checkpoint_state(model, optimizer, _Sliced(source, self.tensor))


class _Sliced:
    """A :class:`PieceSource` that reads divided parameters as this rank's slices of them."""

    def __init__(self, source: PieceSource, tensor: TensorParallel) -> None:
        self.source = source
        self.tensor = tensor

    def state_keys(self, name: str) -> list[str]:
        return self.source.state_keys(name)

    def scalars(self, name: str) -> dict[str, Any]:
        return self.source.scalars(name)

    def read(
        self,
        name: str,
        key: str,
        start: int,
        end: int,
        out: torch.Tensor,
        slices: Slices | None = None,
    ) -> None:
        self.source.read(name, key, start, end, out, slices or self.tensor.slices(name))
