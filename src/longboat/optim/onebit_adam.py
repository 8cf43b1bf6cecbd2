"""1-bit Adam (Tang et al. 2021) as DeepSpeed's ``OnebitAdam`` runs it (docs/compression.md).

1-bit Adam's observation is that Adam's variance becomes stable early in training; once it is
frozen, Adam is a momentum method with a fixed per-element preconditioner, and the momentum
tolerates error-compensated 1-bit communication. Per element, with DeepSpeed's update (no bias
correction, whatever ``bias_correction`` says; weight decay added to the update)::

    warm-up (the first freeze_step steps; gradients all-reduced exactly by the strategy):
        m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    after it (the strategy leaves each rank's gradient local, [Note: self-reducing optimizer]):
        m = b1 m + (1 - b1) g_local    m = onebit_average(m) over the data-parallel ranks
        v unchanged
    both:  p -= lr (m / (sqrt(v) + eps) + weight_decay p)

``onebit_average`` is the 1-bit compressed all-reduce of :mod:`longboat.comm.compression.onebit`
(signs and one scale per chunk, worker and server error feedback) applied to ``m / n``, one
parameter at a time, its residuals keyed by the parameter's place in the optimizer. After it
every rank holds the same momentum. A rank that did not use a parameter in a step contributes
``b1 m`` (a zero gradient, as the exact average counts it); a parameter that no rank used (one
small exact all-reduce of usage flags decides) is not touched at all, neither its momentum nor
its residuals, as in the warm-up, where its gradient is None.

Where it differs from DeepSpeed, on purpose: DeepSpeed's first ``step()`` only allocates its
buffers (no parameter or momentum moves: that batch is lost), here the first step is Adam's;
DeepSpeed's worker side scales the whole tensor by one number, here each of the n chunks has its
own (the compressor the gradient path shares). On loading a checkpoint the error-feedback
residuals restart from zero, as in DeepSpeed (they differ by rank and world size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from longboat.comm.compression.onebit import OneBit
from longboat.comm.protocol import Comm

log = logging.getLogger(__name__)


class OneBitAdam(torch.optim.Optimizer):
    """DeepSpeed's 1-bit Adam (see the module's docstring); DeepSpeed's parameter names.

    ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and, as in
    DeepSpeed, do not change the update; ``cuda_aware`` and ``comm_backend_name`` choose
    DeepSpeed's transport and are ignored (the data-parallel doorway carries the momentum).
    """

    longboat_elementwise = False
    longboat_not_elementwise = (
        "after its freeze_step it all-reduces every parameter's momentum in one step"
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool | None = None,
        comm_backend_name: str | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"OneBitAdam: lr={lr}, eps={eps}, weight_decay={weight_decay}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"OneBitAdam: betas {betas} must lie in [0, 1)")
        if amsgrad:
            raise ValueError("OneBitAdam: amsgrad=True is not supported by 1-bit Adam")
        if freeze_step < 1:
            raise ValueError(
                f"OneBitAdam: freeze_step {freeze_step} must be 1 or more (the variance needs "
                "at least one gradient)"
            )
        if cuda_aware is not None or comm_backend_name is not None:
            log.info(
                "OneBitAdam: cuda_aware=%s, comm_backend_name=%s are DeepSpeed's transport "
                "choices and are ignored: the data-parallel doorway carries the momentum",
                cuda_aware,
                comm_backend_name,
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self._comm: Comm | None = None
        self._onebit = OneBit(0)  # residuals per parameter: "param <i>"

    # -- [Note: self-reducing optimizer] -------------------------------------------------------

    def longboat_bind(self, comm: Comm) -> None:
        self._comm = comm

    def longboat_bound(self) -> bool:
        return self._comm is not None

    def longboat_reduces_gradients(self) -> bool:
        return self.steps_taken() >= self.freeze_step

    def steps_taken(self) -> int:
        """Optimizer steps taken so far (the most any parameter took: checkpoints keep it)."""
        return max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._onebit = OneBit(0)  # residuals restart from zero (see the module's docstring)

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.longboat_reduces_gradients()
        params = [p for g in self.param_groups for p in g["params"]]
        used = self._used_anywhere(params) if compressed else [p.grad is not None for p in params]
        i = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index, i = i, i + 1
                if not used[index]:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if p.grad is not None:
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                else:  # used by another rank only: this rank's gradient is zero
                    exp_avg.mul_(beta1)
                if compressed:
                    self._average(f"param {index}", exp_avg)
                else:
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = exp_avg / (exp_avg_sq.sqrt() + eps)
                if wd > 0:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
        return loss

    def _used_anywhere(self, params: list[torch.Tensor]) -> list[bool]:
        """Which parameters some data-parallel rank has a gradient for (one exact all-reduce
        of flags: it decides which momenta travel, so every rank must agree)."""
        flags = [p.grad is not None for p in params]
        comm = self._comm
        if comm is None or comm.world_size == 1 or not params:
            return flags
        t = torch.tensor(flags, dtype=torch.float32, device=params[0].device)
        comm.all_reduce(t, op="sum", tag="1-bit Adam: usage flags")
        return [f > 0 for f in t.tolist()]

    def _average(self, key: str, exp_avg: torch.Tensor) -> None:
        """``exp_avg`` becomes the 1-bit compressed average of every rank's."""
        comm = self._comm
        if comm is None or comm.world_size == 1:
            return
        flat = exp_avg.flatten().float() / comm.world_size
        self._onebit.all_reduce(key, flat, [(0, flat.shape)], comm)
        exp_avg.copy_(flat.view_as(exp_avg))
