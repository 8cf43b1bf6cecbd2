"""The reference strategy: one process, nothing shared. Every other strategy is tested against
this one."""

from __future__ import annotations

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.optim.self_reducing import ReducesItself
from longboat.pieces import PieceSource, RankState
from longboat.strategies.base import StrategyContext, StrategyDefaults, full_gradient
from longboat.strategies.whole_state import (
    WholeModel,
    load_whole_state,
    whole_model_state,
    whole_state,
)


class Single(WholeModel, StrategyDefaults):
    """Plain single-process training."""

    name = "single"
    can_shadow = True

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.params: list[nn.Parameter] = []

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.params = [p for p in model.parameters() if p.requires_grad]
        if isinstance(optimizer, ReducesItself):  # a world of one: its averages are identities
            optimizer.longboat_bind(self.ctx.topology.data("dp"))
        return model

    def before_forward(self) -> None:
        pass

    def before_backward(self, sync: bool) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def shadow(self) -> None:
        pass  # no other rank: only the last step of a loop is finished this way

    def buffers_from(self, rank: int) -> None:
        pass

    def finish_gradients(self) -> None:
        pass

    def wait_gradients(self) -> None:
        pass

    def hooked_modules(self) -> list[nn.Module]:
        return []  # no forward hooks

    def norm_groups(self) -> list[Comm]:
        return []

    def local_gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        return full_gradient(param)

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """[Note: memory formulas]: the whole model, its gradients and its optimizer state."""
        return whole_model_state(a, k)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        return whole_state(model, optimizer)

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        load_whole_state(model, optimizer, source)

    def close(self) -> None:
        pass

    def leave(self) -> None:
        pass
