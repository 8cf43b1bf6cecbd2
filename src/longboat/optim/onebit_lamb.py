"""1-bit LAMB (Li et al. 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed", arXiv:2104.06069) as DeepSpeed's ``OnebitLamb`` runs it
(docs/compression.md).

LAMB scales each parameter's Adam-style update by a trust ratio ``|p| / |u|``, which depends on
the whole, exact momentum: once the momentum is communicated in 1 bit, the ratio computed from
it would be noise. 1-bit LAMB therefore learns, during an exact warm-up, a running average of
each parameter's ratio, freezes it together with the variance, and afterwards only adjusts it by
how much the variance has moved since. [Note: 1-bit LAMB rule] Per parameter, with DeepSpeed's
update (no bias correction, whatever ``bias_correction`` says; weight decay added to the
update)::

    warm-up (the first freeze_step steps; gradients all-reduced exactly by the strategy):
        m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2        v_fresh = v
        u = m / (sqrt(v) + eps) + wd p
        c = clamp(|p| / |u|, min_coeff, max_coeff)       (1 where |p| or |u| is 0)
        c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c     (c_frozen starts at 0)
        p -= lr c u
    after it (the strategy leaves each rank's gradient local, [Note: self-reducing optimizer]):
        m_prev = m
        m = b1 m + (1 - b1) g_local    m = onebit_average(m)      v unchanged
        g_seen = (m - b1 m_prev) / (1 - b1)         the average gradient the momentum implies
        v_fresh = b2 v_fresh + (1 - b2) g_seen^2
        u_pre = m / (sqrt(v) + eps)    u = u_pre + wd p
        f = max over elements of (sqrt(v) + eps) / (sqrt(v_fresh) + eps)
        with wd > 0: r = min(1, |u_pre| / |u|), f = f r + (1 - r)
        f clamped to [factor_min, factor_max], then to within factor_threshold of the last f
        p -= lr (c_frozen f) u

``onebit_average`` is 1-bit Adam's (:mod:`longboat.optim.onebit_momentum`): one parameter at a
time, a scale per chunk, worker and server residuals. Unused parameters are treated as 1-bit
Adam treats them.

Where it differs from DeepSpeed, on purpose: DeepSpeed's first ``step()`` only allocates its
buffers (that batch moves nothing), here it is a LAMB step. DeepSpeed flattens every momentum
into one buffer compressed with one scale per chunk, and so multiplies each momentum by a
coefficient frozen at the end of the warm-up (the mean of the momenta's RMS over this one's) to
bring the layers to one magnitude before compressing, and divides it out after; here each
momentum is compressed on its own with a scale per chunk, which such a factor would not change
(the compression commutes with a positive scale, residuals included), so none is kept.
``v_fresh`` follows ``v`` through every warm-up step of the parameter (DeepSpeed copies it at
step ``freeze_step`` only, which a parameter that missed that step never reaches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from longboat.optim.onebit_momentum import OneBitMomentum


class OneBitLamb(OneBitMomentum):
    """DeepSpeed's 1-bit LAMB ([Note: 1-bit LAMB rule]); DeepSpeed's parameter names and
    defaults.

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool | None = None,
        comm_backend_name: str | None = None,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"OneBitLamb: min_coeff={min_coeff}, max_coeff={max_coeff}: 0 <= min <= max"
            )
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"OneBitLamb: coeff_beta={coeff_beta} must lie in [0, 1)")
        if not 0 < factor_min <= factor_max:
            raise ValueError(
                f"OneBitLamb: factor_min={factor_min}, factor_max={factor_max}: 0 < min <= max"
            )
        if not 0 <= factor_threshold < 1:
            raise ValueError(f"OneBitLamb: factor_threshold={factor_threshold} must lie in [0, 1)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults, freeze_step, amsgrad, cuda_aware, comm_backend_name)
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.longboat_reduces_gradients()
        self.lamb_coeffs = []
        for key, group, p in self._to_step(compressed):
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for k in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["lamb_coeff_freeze"] = torch.tensor(0.0)
                state["last_factor"] = torch.tensor(1.0)
            state["step"] += 1
            if compressed:
                coeff = self._compressed(p, group, state, key)
            else:
                coeff = self._warm_up(p, group, state)
            self.lamb_coeffs.append(coeff)
        return loss

    def _warm_up(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> float:
        """LAMB on the exactly averaged gradient; learns the frozen coefficient."""
        beta1, beta2 = group["betas"]
        g = p.grad
        assert g is not None  # in the warm-up only parameters with a gradient are stepped
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state["exp_avg_sq_fresh"].copy_(v)
        update = m / (v.sqrt() + group["eps"])
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        w_norm, u_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if w_norm != 0 and u_norm != 0:
            coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:  # DeepSpeed's rule: a ratio of exactly 1 (a zero norm) is not averaged
            frozen = state["lamb_coeff_freeze"]
            frozen.mul_(self.coeff_beta).add_(coeff * (1 - self.coeff_beta))
        p.add_(update, alpha=-group["lr"] * coeff)
        return coeff

    def _compressed(
        self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], key: str
    ) -> float:
        """The momentum averaged in 1 bit, the variance frozen, the frozen coefficient scaled by
        how far a fresh variance has moved from the frozen one."""
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        previous = m.clone()
        if p.grad is not None:
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        else:  # used by another rank only: this rank's gradient is zero
            m.mul_(beta1)
        self._average(key, m)
        seen = (m - beta1 * previous) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(seen, seen, value=1 - beta2)
        denom = v.sqrt().add_(eps)
        update_pre = m / denom
        update = update_pre + wd * p if wd > 0 else update_pre
        factor = float((denom / fresh.sqrt().add_(eps)).max())
        if wd > 0:
            u_norm = float(update.norm())
            ratio = min(1.0, float(update_pre.norm()) / u_norm) if u_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = float(state["last_factor"])
        low, high = last * (1.0 - self.factor_threshold), last * (1.0 + self.factor_threshold)
        factor = min(max(factor, low), high)
        state["last_factor"].fill_(factor)
        coeff = float(state["lamb_coeff_freeze"]) * factor
        p.add_(update, alpha=-group["lr"] * coeff)
        return coeff

    def get_lamb_coeffs(self) -> list[float]:
        """The coefficients of the last step, one per parameter stepped (DeepSpeed's name)."""
        return list(self.lamb_coeffs)
