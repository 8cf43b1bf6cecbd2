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

from collections.abc import Callable, Iterable
from typing import Any

import torch

from longboat.optim.onebit_momentum import OneBitMomentum


class OneBitAdam(OneBitMomentum):
    """DeepSpeed's 1-bit Adam (see the module's docstring); DeepSpeed's parameter names.

    ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and, as in
    DeepSpeed, do not change the update; ``cuda_aware`` and ``comm_backend_name`` choose
    DeepSpeed's transport and are ignored (the data-parallel doorway carries the momentum).
    """

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
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(params, defaults, freeze_step, amsgrad, cuda_aware, comm_backend_name)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.longboat_reduces_gradients()
        for key, group, p in self._to_step(compressed):
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
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
                self._average(key, exp_avg)
            else:
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            update = exp_avg / (exp_avg_sq.sqrt() + eps)
            if wd > 0:
                update.add_(p, alpha=wd)
            p.add_(update, alpha=-lr)
        return loss
