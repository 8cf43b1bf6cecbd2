"""Horovod's ``DistributedOptimizer``: gradients reduced across ranks before each ``step()``.

[Note: Horovod optimizer order] Horovod launches each gradient's allreduce from a hook during
the backward and agrees on the order between ranks at run time; launched from hooks here, a
parameter that one rank's backward did not reach would put the ranks' collectives out of order,
so the gradients are reduced in ``step()`` instead, in the optimizer's parameter order, as one
grouped allreduce (one flat buffer per dtype, as Horovod's fusion buffer packs them): an order
every rank shares, at the price of Horovod's overlap with the backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from longboat.horovod import collectives as c
from longboat.horovod.compression import Compression
from longboat.horovod.process_sets import ProcessSet


def _check_names(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None
) -> dict[int, str]:
    """Horovod's checks of ``named_parameters``: (name, parameter) pairs, names unique, every
    parameter of the optimizer named. Returns each parameter's name by id."""
    if named_parameters is None:
        return {}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, usually "
            "produced by model.named_parameters()"
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique; duplicates: {dups}")
    by_id = {id(p): n for n, p in named}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            f"named_parameters was given, but it does not name {len(unnamed)} of the optimizer's "
            f"parameters (positions {unnamed[:5]} in its param_groups); pass "
            "model.named_parameters() of the model the optimizer optimizes"
        )
    return by_id


class _DistributedOptimizer:
    """Wraps an optimizer: gradients reduced across ranks before each ``step()``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: Any,
        op: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: ProcessSet | None,
    ) -> None:
        self.optimizer = optimizer
        self.names = _check_names(optimizer, named_parameters)
        self.compression, self.op, self.sparse_as_dense = compression, op, sparse_as_dense
        self.process_set = process_set
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: use 1 or more")
        self.backward_passes_per_step = backward_passes_per_step
        if gradient_predivide_factor != 1.0 and op != c.Average:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor} needs op=hvd.Average "
                f"(got {op!r}), as in Horovod"
            )
        self.predivide = gradient_predivide_factor

    def synchronize(self) -> None:
        """Reduce every gradient across ranks ([Note: Horovod optimizer order]); a parameter
        this rank did not use contributes zeros."""
        dense: list[torch.Tensor] = []
        sparse: list[torch.nn.Parameter] = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if p.grad.is_sparse:
                    if not self.sparse_as_dense:
                        sparse.append(p)
                        continue
                    p.grad = p.grad.to_dense()
                dense.append(p.grad)
        # Horovod's predivide: 1/f before the sum, f after it (Average then divides by size).
        c.grouped_allreduce_(
            dense,
            op=self.op,
            prescale_factor=1.0 / self.predivide,
            postscale_factor=self.predivide,
            compression=self.compression,
            name="DistributedOptimizer",
            process_set=self.process_set,
        )
        for p in sparse:
            assert p.grad is not None
            p.grad = c.sparse_allreduce(p.grad, self.names.get(id(p)), self.op, self.process_set)

    def step(self, closure: Any = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict, ...
        return getattr(self.optimizer, name)


def DistributedOptimizer(  # Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = c.Average,
    gradient_predivide_factor: float = 1.0,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = None,
    **_: Any,
) -> Any:
    """``optimizer`` whose ``step()`` first reduces every gradient across ranks ([Note: Horovod
    optimizer order]). Gradients accumulated over ``backward_passes_per_step`` backward passes
    are reduced at the ``step()`` that follows them, summed over the passes as Horovod does;
    ``gradient_predivide_factor`` f divides by f before the sum and multiplies by f/size after
    it (op Average only); sparse gradients are gathered (``hvd.sparse_allreduce``), or
    densified first with ``sparse_as_dense=True``; ``process_set``: the ranks that average."""
    return _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression,
        c._op(None, op),
        backward_passes_per_step,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )
