"""The optimizer side of 1-bit Adam (Tang et al. 2021): Adam whose second moment stops
changing after a warm-up, offered with ``compression.method = "onebit"`` (docs/compression.md).

1-bit Adam's observation is that Adam's variance becomes stable early in training; once it is
frozen, Adam is a momentum method with a fixed per-element preconditioner, whose updates
tolerate error-compensated 1-bit communication. :class:`OneBitAdam` is AdamW exactly (torch's
single-tensor algorithm: decoupled weight decay, bias correction) for its first ``freeze_step``
steps; after them ``exp_avg_sq`` is left as it was, and its bias correction stays at
``freeze_step``. Set ``freeze_step`` to ``compression.warmup_steps``, so that the variance
freezes when the gradients start to travel compressed.

What is compressed differs from DeepSpeed's ``OnebitAdam``: there, after the warm-up, each
worker updates its momentum with its own gradient and the *momentum* is all-reduced with 1-bit
compression. Here the *gradient* is reduced with the same 1-bit compression (worker and server
error feedback, by the strategy, under any data-parallel strategy) and every rank then updates
the same momentum from it. The momentum is linear in the gradients, so the two differ only in
what the error feedback compensates (a gradient's residual rather than a momentum's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class OneBitAdam(torch.optim.Optimizer):
    """AdamW whose variance freezes after ``freeze_step`` steps (see the module's docstring).

    Element-wise: each element's update reads its own state alone, so ZeRO may step it on
    shards and replicate bucket by bucket.
    """

    longboat_elementwise = True  # see longboat.optim.is_elementwise

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"OneBitAdam: lr={lr}, eps={eps}, weight_decay={weight_decay}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"OneBitAdam: betas {betas} must lie in [0, 1)")
        if freeze_step < 1:
            raise ValueError(
                f"OneBitAdam: freeze_step {freeze_step} must be 1 or more (the variance needs "
                "at least one gradient)"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "freeze_step": freeze_step,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            freeze = group["freeze_step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                if step <= freeze:  # after freeze_step, the variance is what it was then
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1**step
                bias2_sqrt = (1 - beta2 ** min(step, freeze)) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias1)
        return loss
