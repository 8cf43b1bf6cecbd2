"""The home of ZeRO units kept beside their parameters ([Note: homes] in ``homes.py``), which
the other homes build on for what they keep in memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from longboat.pieces import RankState
from longboat.strategies.zero.flat import FlatUnit
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.strategies.zero.storage import empty

if TYPE_CHECKING:  # named in signatures only (the imports would deepen the import floors)
    from longboat.grads import HeldGradients
    from longboat.strategies.base import StrategyContext
    from longboat.strategies.zero.home import StepUnit


class InMemory:
    """Every unit's state beside its parameters ([Note: homes])."""

    grads_in_memory = True
    steps_by_unit = False
    hands_back_to: torch.device | None = None

    def __init__(self, ctx: StrategyContext, policy: ZeroPolicy) -> None:
        self.cfg = ctx.section
        self.policy = policy
        self.units: list[FlatUnit] = []

    def adopt(self, u: FlatUnit) -> None:
        self.units.append(u)

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # nothing to set up: the optimizer steps the shards where they are

    def bring_param(self, u: FlatUnit) -> None:
        pass

    def param_ready(self, u: FlatUnit) -> None:
        pass

    def drop_param(self, u: FlatUnit) -> None:
        pass

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return empty(numel, dtype, device)

    def launched(self, units: list[FlatUnit], index: int) -> None:
        pass

    def land(self, u: FlatUnit) -> None:
        reduced = wait_reduction(u)
        if self.policy.shard_grads:
            assert u.grad_shard is not None
            if reduced is not u.grad_shard:  # [Note: reduce in place] in ``reduce.py``
                u.grad_shard.add_(reduced)
            u.flat_grad = None
        else:
            assert u.flat_grad is not None
            u.flat_grad[u.lo : u.hi].copy_(reduced)

    def grad_pieces(self, u: FlatUnit) -> list[torch.Tensor]:
        grad = u.grad_view()
        return [grad[a:b] for _, a, b, _ in u.pieces]

    def local_gradients(self) -> list[torch.Tensor]:
        return [u.grad_view() for u in self.units]

    def step(self, optimizer: torch.optim.Optimizer, step_unit: StepUnit) -> None:
        for u in self.units:
            step_unit(u)

    def stepped(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        pass  # the pieces are views of the shard: it holds the update already

    def step_over(self) -> None:
        for u in self.units:
            u.grad_view().zero_()

    @contextlib.contextmanager
    def reading(
        self, optimizer: torch.optim.Optimizer
    ) -> Iterator[Callable[[RankState], RankState]]:
        yield lambda state: state

    @contextlib.contextmanager
    def loading(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        yield

    def held_gradients(self) -> HeldGradients | None:
        return None

    @property
    def on_disk(self) -> dict[str, int]:
        return {}

    @property
    def on_host(self) -> dict[str, int]:
        return {}

    @property
    def offloaded(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        pass


def wait_reduction(u: FlatUnit) -> torch.Tensor:
    """``u``'s reduction, over: what it reduced into."""
    assert u.reduce_handle is not None  # a reduction is in flight
    u.reduce_handle.wait()
    u.reduce_handle = None
    reduced, u.reduced = u.reduced, None
    assert reduced is not None
    return reduced
