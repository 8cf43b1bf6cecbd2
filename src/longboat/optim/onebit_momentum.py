"""What 1-bit Adam and 1-bit LAMB share: an exact warm-up of ``freeze_step`` steps, then each
rank's momentum averaged over the data-parallel ranks in 1 bit ([Note: self-reducing optimizer]).

:class:`OneBitMomentum` holds the doorway a strategy binds, answers the strategy's question
(local gradients from the step after the warm-up on), decides once per compressed step which
parameters some rank used (one small exact all-reduce of flags, so every rank compresses the
same momenta), and averages one momentum with :class:`~longboat.comm.compression.onebit.OneBit`,
its residuals keyed by the parameter's place in the optimizer. Each optimizer writes its own
``step``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from longboat.comm.compression.onebit import OneBit
from longboat.comm.protocol import Comm

log = logging.getLogger(__name__)


class OneBitMomentum(torch.optim.Optimizer):
    """The base of ``OneBitAdam`` and ``OneBitLamb`` (see the module's docstring)."""

    longboat_elementwise = False
    longboat_not_elementwise = (
        "after its freeze_step it all-reduces every parameter's momentum in one step"
    )

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        freeze_step: int,
        amsgrad: bool,
        cuda_aware: bool | None,
        comm_backend_name: str | None,
    ) -> None:
        name = type(self).__name__
        lr, eps, wd, betas = (defaults[k] for k in ("lr", "eps", "weight_decay", "betas"))
        if lr < 0 or eps < 0 or wd < 0:
            raise ValueError(f"{name}: lr={lr}, eps={eps}, weight_decay={wd}: use >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"{name}: betas {betas} must lie in [0, 1)")
        if amsgrad:
            raise ValueError(f"{name}: amsgrad=True is not supported (DeepSpeed refuses it too)")
        if freeze_step < 1:
            raise ValueError(
                f"{name}: freeze_step {freeze_step} must be 1 or more (the variance needs "
                "at least one gradient)"
            )
        if cuda_aware is not None or comm_backend_name is not None:
            log.info(
                "%s: cuda_aware=%s, comm_backend_name=%s are DeepSpeed's transport choices and "
                "are ignored: the data-parallel doorway carries the momentum",
                name,
                cuda_aware,
                comm_backend_name,
            )
        super().__init__(params, defaults)
        if any("exp_avg_mask" in g for g in self.param_groups):
            raise ValueError(
                f"{name}: the param-group key 'exp_avg_mask' (DeepSpeed's mask of momentum "
                "elements that stay zero) is not offered here; leave it out, or use a larger eps "
                "(docs/compression.md)"
            )
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
        # The residuals differ by rank and world size and are not saved: they restart from
        # zero, as in DeepSpeed.
        self._onebit = OneBit(0)

    # -- shared by the steps -------------------------------------------------------------------

    def _used(self, compressed: bool) -> list[bool]:
        """Per parameter in the optimizer's order: whether to step it. In the warm-up, whether
        this rank has a gradient (the strategy averaged them: alike on every rank); after it,
        whether some data-parallel rank has one (one exact all-reduce of flags: it decides
        which momenta travel, so every rank must agree)."""
        params = [p for g in self.param_groups for p in g["params"]]
        flags = [p.grad is not None for p in params]
        comm = self._comm
        if not compressed or comm is None or comm.world_size == 1 or not params:
            return flags
        t = torch.tensor(flags, dtype=torch.float32, device=params[0].device)
        comm.all_reduce(t, op="sum", tag=f"{type(self).__name__}: usage flags")
        return [f > 0 for f in t.tolist()]

    def _to_step(self, compressed: bool) -> list[tuple[str, dict[str, Any], torch.Tensor]]:
        """(residual key, param group, parameter) of every parameter this step updates, in the
        optimizer's order (:meth:`_used` decides which; the key is its place in that order)."""
        used = self._used(compressed)
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        return [(f"param {i}", g, p) for i, (g, p) in enumerate(params) if used[i]]

    def _average(self, key: str, exp_avg: torch.Tensor) -> None:
        """``exp_avg`` becomes the 1-bit compressed average of every rank's."""
        comm = self._comm
        if comm is None or comm.world_size == 1:
            return
        flat = exp_avg.flatten().float() / comm.world_size
        self._onebit.all_reduce(key, flat, [(0, flat.shape)], comm)
        exp_avg.copy_(flat.view_as(exp_avg))
