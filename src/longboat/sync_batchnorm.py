"""SyncBatchNorm on any device: batch statistics over every data-parallel rank's samples.

[Note: sync batchnorm] ``torch.nn.SyncBatchNorm`` refuses CPU tensors; this one rides on the
data-parallel doorway, whatever its backend. In training, the forward all-reduces one packed
``[sum x, sum x^2, count]`` per layer (per channel), so mean and variance are those of the
union of the ranks' samples; the backward all-reduces one packed ``[sum dy, sum dy * x_hat]`` and
forms the input gradient as full-batch batch norm does:

    dx = w / sigma * (dy - mean(dy) - x_hat * mean(dy * x_hat))

with the means over the union. The weight and bias get this rank's share (``sum dy * x_hat``,
``sum dy``), which the strategy then averages like every gradient. Running statistics follow
torch's rules (the running variance unbiased, over the union's count; ``momentum=None`` is the
cumulative average). In eval mode, on one rank, or outside a training forward it is plain
``F.batch_norm``. ``sync_batchnorm = true`` converts every ``BatchNorm1d/2d/3d`` of the model
(the same parameter and buffer objects, under the same names).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longboat.comm.protocol import Comm


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        comm: Comm,
        stats_out: list[torch.Tensor],
    ) -> torch.Tensor:
        dims = [d for d in range(x.dim()) if d != 1]
        xf = x.float()
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32, device=x.device)
        packed = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        comm.all_reduce(packed)
        c = x.shape[1]
        n = packed[2 * c]
        mean = packed[:c] / n
        var = (packed[c : 2 * c] / n - mean * mean).clamp(min=0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, c] + [1] * (x.dim() - 2)
        x_hat = (xf - mean.view(shape)) * invstd.view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.float().view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.comm, ctx.n, ctx.dims, ctx.shape = comm, n, dims, shape
        ctx.has_bias = bias is not None
        stats_out += [mean, var, n]
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x_hat, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dyf = dy.float()
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * x_hat).sum(dims)
        packed = torch.cat([sum_dy, sum_dy_xhat])
        ctx.comm.all_reduce(packed)
        c = sum_dy.numel()
        mean_dy = (packed[:c] / ctx.n).view(shape)
        mean_dy_xhat = (packed[c:] / ctx.n).view(shape)
        scale = invstd.view(shape)
        if weight is not None:
            scale = scale * weight.float().view(shape)
        dx = scale * (dyf - mean_dy - x_hat * mean_dy_xhat)
        dw = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        db = sum_dy.to(weight.dtype if weight is not None else dy.dtype) if ctx.has_bias else None
        return dx.to(dy.dtype), dw, db, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm with its training statistics over every data-parallel rank (see [Note: sync
    batchnorm]); built by :func:`convert` from an existing batch norm."""

    comm: Comm | None = None

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {x.dim()}-D)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        comm = self.comm
        if not (self.training and comm is not None and comm.world_size > 1):
            return super().forward(x)
        stats: list[torch.Tensor] = []
        # torch's Function.apply is unannotated
        y: torch.Tensor = _SyncBatchNormFn.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.bias, self.eps, comm, stats
        )
        if self.track_running_stats and self.running_mean is not None:
            mean, var, n = stats
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
                m = (
                    1.0 / float(self.num_batches_tracked)  # type: ignore[arg-type]
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(  # type: ignore[union-attr]
                    unbiased.to(self.running_var.dtype),  # type: ignore[union-attr]
                    alpha=m,
                )
        return y


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def convert(model: nn.Module, comm: Comm) -> int:
    """Turn every ``BatchNorm1d/2d/3d`` of ``model`` into a :class:`SyncBatchNorm` over
    ``comm`` in place (same parameters and buffers, same names); the number converted."""
    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BATCH_NORMS) and not isinstance(child, SyncBatchNorm):
                sync = SyncBatchNorm.__new__(SyncBatchNorm)
                sync.__dict__.update(child.__dict__)  # parameters, buffers, hooks, settings
                sync.comm = comm
                setattr(parent, name, sync)
                converted += 1
    return converted


__all__ = ["SyncBatchNorm", "convert"]
