"""Horovod's gradient compression: what a tensor is reduced as on the wire."""

from __future__ import annotations

import torch


class Compression:
    """Gradient compression on the wire: ``none``, or ``fp16`` (floating-point tensors cast to
    float16 for the reduction, the result cast back; other tensors as they are)."""

    class none:  # Horovod's names
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
            return t, t.dtype

        @staticmethod
        def decompress(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t

    class fp16:
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
            return (t.to(torch.float16) if t.is_floating_point() else t), t.dtype

        @staticmethod
        def decompress(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(dtype)


__all__ = ["Compression"]
