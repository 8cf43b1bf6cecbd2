"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv:1904.00962) with DeepSpeed's parameter names, for DeepSpeed configs with
``"optimizer": {"type": "Lamb"}``.

Written here because ``torch.optim`` has no LAMB and DeepSpeed's ``FusedLamb`` is a CUDA kernel;
this one is plain tensor arithmetic on any device. [Note: LAMB rule] It follows FusedLamb's rule
(DeepSpeed's ``csrc/lamb/fused_lamb_cuda_kernel.cu``), which is the paper's with Adam's bias
correction folded into the step size, as NVIDIA apex's fused Adam does. For each parameter ``p``
with gradient ``g``, at step ``t``::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p        # sqrt(v + eps) with eps_inside_sqrt
    ratio = clamp(|p| / |u|, min_coeff, max_coeff)    # 1 where |p| or |u| is 0
    step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)   # lr without bias_correction
    p = p - step_size * ratio * u

``|.|`` is the L2 norm of the **whole** parameter tensor (``|p|`` before the update): the trust
ratio couples every element of a parameter, so the rule is not element-wise and cannot be
applied to a ZeRO shard of a parameter alone; strategy ``zero`` refuses it (as DeepSpeed's own
ZeRO does not list FusedLamb among the optimizers it supports), and ``replicate`` steps it once
per step on whole parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB with a clamped per-parameter trust ratio ([Note: LAMB rule]); DeepSpeed FusedLamb's
    parameters and defaults. ``max_grad_norm`` (FusedLamb clips by a norm the caller passes to
    ``step``) is accepted at 0 only: clip with the config's ``gradient_clipping``. ``amsgrad``
    is refused, as FusedLamb refuses it."""

    #: Why strategy 'zero' cannot step it on shards (read by ``optim.why_not_elementwise``).
    longboat_not_elementwise = (
        "LAMB's trust ratio divides the norm of each whole parameter by the norm of its whole "
        "update, which a shard alone does not know"
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb: amsgrad=True is not a LAMB variant (FusedLamb refuses it too)")
        if max_grad_norm:
            raise ValueError(
                f"Lamb: max_grad_norm={max_grad_norm} is not supported; clip the gradients with "
                "the config's gradient_clipping instead"
            )
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr={lr}, eps={eps}, weight_decay={weight_decay}: use >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas={betas}: each must be in [0, 1)")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: min_coeff={min_coeff}, max_coeff={max_coeff}: 0 <= min <= max")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self.lamb_coeffs.append(self._update(p, group, beta1, beta2))
        return loss

    def _update(
        self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float
    ) -> torch.Tensor:
        g = p.grad
        assert g is not None
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = int(state["step"].item())
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        eps = group["eps"]
        denom = (v + eps).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(eps)
        update = m / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        w_norm, u_norm = p.norm(), update.norm()
        ratio = torch.where(
            (w_norm > 0) & (u_norm > 0),
            (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
            torch.ones_like(w_norm),
        )
        step_size = group["lr"]
        if group["bias_correction"]:
            step_size *= math.sqrt(1 - beta2**t) / (1 - beta1**t)
        p.add_(update * ratio, alpha=-step_size)
        return ratio

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per parameter stepped (FusedLamb's name)."""
        return [float(c) for c in self.lamb_coeffs]
