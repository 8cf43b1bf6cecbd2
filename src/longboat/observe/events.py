"""The step event every monitor receives, and the rule for counting tokens in a batch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step as seen by the whole job (values already reduced across ranks).

    ``loss`` is the mean over ranks of each rank's mean micro-batch loss of this step (with
    equal micro-batches, the loss of the global batch). ``step_ms`` is the slowest rank's mean
    step time since the previous event; ``samples_per_s`` and ``tokens_per_s`` divide the
    global batch's samples and tokens by it. ``phases_ms`` (with the wall-clock breakdown on)
    are means over ranks and over the steps since the previous event.
    """

    step: int
    loss: float | None
    lr: float
    step_ms: float
    samples_per_s: float
    tokens_per_s: float | None = None
    loss_scale: float | None = None
    phases_ms: Mapping[str, float] = field(default_factory=dict)
    flops_per_step: float | None = None  # whole job: per rank x ranks
    achieved_tflops_per_rank: float | None = None
    #: what the strategy reports besides (parameter servers: each worker's staleness)
    extra: Mapping[str, float] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """Every value this event has, by flat name (no ``step``)."""
        out = {
            "loss": self.loss,
            "lr": self.lr,
            "loss_scale": self.loss_scale,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "step_ms": self.step_ms,
            "flops_per_step": self.flops_per_step,
            "achieved_tflops_per_rank": self.achieved_tflops_per_rank,
        }
        out.update({f"{k}_ms": v for k, v in self.phases_ms.items()})
        out.update(self.extra)
        return {k: float(v) for k, v in out.items() if v is not None and not math.isnan(v)}


class Sink(Protocol):
    """Where events go: a console, a file."""

    def write(self, event: StepEvent) -> None: ...

    def close(self) -> None: ...


def count_tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Tokens in one forward's inputs, by longboat's rule: the first integer tensor of two or
    more dimensions among the positional then keyword arguments holds token ids shaped
    ``(batch, sequence, ...)``, and each of its first two dimensions' entries is a token
    (``batch x sequence``). 0 when there is none (images, features: no tokens/s is reported)."""
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and not value.dtype.is_floating_point
            and not value.dtype.is_complex
            and value.dtype != torch.bool
        ):
            return value.shape[0] * value.shape[1]
    return 0
