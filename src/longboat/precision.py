"""Mixed precision: the dtype the forward computes in, and fp16's loss scaling.

The master weights are the model's own fp32 parameters: they are never converted. The forward
runs under ``torch.autocast``, which casts per operation (matrix products and convolutions to
bf16/fp16, reductions, norms and losses kept in fp32), so gradients reach the parameters, the
strategy's buckets and the optimizer in fp32. Outputs are cast back to fp32, so a loss the user
computes outside the forward is computed in fp32 (as Lightning Fabric does).

- ``fp32``: no autocast, nothing scaled, nothing checked.
- ``bf16``: autocast to bf16. bf16 has fp32's exponent range, so no loss scaling is needed and
  nothing is checked (as in DeepSpeed).
- ``fp16``: autocast to fp16, whose largest value is 65504 and whose smallest normal is 6e-5:
  small gradients of the fp16 operations underflow to zero. The loss is multiplied by a scale
  before backward and the fp32 gradients divided by it before clipping and the optimizer
  ([Note: loss scaling]).

[Note: loss scaling] The scale is a power of two, so scaling and unscaling fp32 gradients is
exact. A too-large scale makes some fp16 gradient inf or NaN. At each optimizer step the engine
unscales the gradients this rank owns and looks for inf/NaN; the flag is all-reduced with MAX, so
an overflow on any rank (or in any shard) makes *every* rank skip the same step: no optimizer
step, no scheduler step, gradients dropped. The dynamic scale then follows DeepSpeed's rules:
an overflow spends one unit of hysteresis, and once none is left halves the scale (never below
``min_loss_scale``; an overflow that would need to go below it is an error); ``loss_scale_window``
steps in a row without overflow double the scale and refill the hysteresis. A static scale
(``loss_scale > 0``) never changes, but overflowing steps are still skipped.

[Note: skipped step] A skipped step is the strategy's own ``optimizer_step`` given an optimizer
whose ``step`` does nothing (:class:`SkippedStep`), so each strategy's bookkeeping around the
step (waiting, zeroing its gradient buffers, re-gathering shards) runs as usual while no
parameter and no optimizer state changes. The engine needs no branch per strategy for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from longboat.comm.protocol import Comm
from longboat.config.sections import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

log = logging.getLogger("longboat")


class LossScaleError(RuntimeError):
    """fp16 gradients overflowed although the loss scale is already at its minimum."""


class LossScaler:
    """The fp16 loss scale and DeepSpeed's rules for changing it (see [Note: loss scaling])."""

    def __init__(
        self,
        scale: float,
        dynamic: bool = True,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        if scale <= 0 or window < 1 or hysteresis < 1 or min_scale <= 0:
            raise ValueError(
                f"invalid loss scaler: scale={scale}, window={window}, "
                f"hysteresis={hysteresis}, min_scale={min_scale}"
            )
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.good_steps = 0  # steps without overflow since the last overflow

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> LossScaler:
        if cfg.loss_scale > 0:
            return cls(cfg.loss_scale, dynamic=False)
        return cls(
            2.0**cfg.initial_scale_power,
            dynamic=True,
            window=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
            min_scale=cfg.min_loss_scale,
        )

    def update(self, found_inf: bool, step: int) -> None:
        """Apply one optimizer step's outcome; ``step`` (1-based) only names it in messages."""
        old = self.scale
        if not self.dynamic:
            if found_inf:
                log.info(
                    "step %d: fp16 gradient overflow (inf/NaN), optimizer step skipped; "
                    "static loss scale %g kept",
                    step,
                    old,
                )
            return
        if not found_inf:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis
            return
        self.good_steps = 0
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            left = self.hysteresis_left
            when = "the next overflow halves it" if left == 1 else f"{left} more overflows halve it"
            log.info(
                "step %d: fp16 gradient overflow (inf/NaN), optimizer step skipped; loss "
                "scale %g -> %g (kept by hysteresis; %s)",
                step,
                old,
                old,
                when,
            )
            return
        if self.scale <= self.min_scale:
            raise LossScaleError(
                f"step {step}: fp16 gradients overflowed (inf/NaN) with the loss scale already "
                f"at its minimum {self.scale:g} (precision.min_loss_scale): the gradients are not "
                "finite even unscaled. Look for a diverging loss or bad input (lower the "
                "learning rate, set gradient_clipping), train in bf16 (precision.dtype = "
                "'bf16'), or lower precision.min_loss_scale."
            )
        self.scale = max(self.scale / 2.0, self.min_scale)
        log.info(
            "step %d: fp16 gradient overflow (inf/NaN), optimizer step skipped; loss scale "
            "%g -> %g",
            step,
            old,
            self.scale,
        )

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "good_steps": self.good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.good_steps = int(state["good_steps"])


class SkippedStep:
    """An optimizer stand-in whose ``step`` does nothing (see [Note: skipped step])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # param_groups, state, ... of the real one
        return getattr(self._optimizer, name)


class Precision:
    """The precision policy of a run: autocast for the forward, loss scaling for fp16."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device | str) -> None:
        self.name = cfg.dtype
        self.dtype = DTYPES[cfg.dtype]
        self.device = torch.device(device)  # where the gradients (and so the checks) live
        self.device_type = self.device.type
        self.scaler = LossScaler.from_config(cfg) if cfg.dtype == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward runs in: ``torch.autocast`` unless fp32."""
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def cast_output(self, out: Any) -> Any:
        """Low-precision floating tensors in the forward's output, cast back to fp32."""
        if self.dtype == torch.float32:
            return out
        return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == self.dtype else t, out)

    def describe(self) -> str:
        """One line for the start-up log ('' for fp32)."""
        if self.dtype == torch.float32:
            return ""
        text = (
            f"{self.name}: forward under torch.autocast({self.device_type!r}, "
            f"{self.dtype}), fp32 master weights"
        )
        s = self.scaler
        if s is None:
            return text + ", no loss scaling"
        if not s.dynamic:
            return text + f", static loss scale {s.scale:g}"
        return text + (
            f", dynamic loss scale {s.scale:g} (window {s.window}, hysteresis "
            f"{s.hysteresis}, min {s.min_scale:g})"
        )

    @property
    def checks_overflow(self) -> bool:
        """True when each step's gradients must be unscaled and checked (fp16)."""
        return self.scaler is not None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged unless fp16)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def unscale_and_check(self, grads: list[torch.Tensor], comm: Comm) -> bool:
        """Divide ``grads`` by the loss scale in place; True if any rank has an inf/NaN.

        Every rank must call this at the same step (it all-reduces the flag) and gets the same
        answer. Without a scaler it does nothing and returns False, without communicating.
        """
        if self.scaler is None:
            return False
        inv = 1.0 / self.scaler.scale
        flag = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            g.mul_(inv)
            flag = torch.maximum(flag, (~torch.isfinite(g)).any().float())
        flag = flag.cpu()  # read by the CPU anyway: agreed on the control plane
        comm.all_reduce(flag, op="max")
        return bool(flag.item())

    def update(self, found_inf: bool, step: int) -> None:
        """Adjust the loss scale after a step (fp16 only); may raise :class:`LossScaleError`."""
        if self.scaler is not None:
            self.scaler.update(found_inf, step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.name,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
