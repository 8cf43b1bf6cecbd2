"""Gradient compression for the data-parallel reduction of ``replicate`` and ``zero``
(docs/compression.md): one method per file behind :class:`Compressor`
([Note: compressed reduction] in ``protocol.py``)."""

from __future__ import annotations

from typing import Any

from longboat.comm.compression.onebit import OneBit
from longboat.comm.compression.powersgd import PowerSGD
from longboat.comm.compression.protocol import Compressor, Span
from longboat.comm.protocol import Done

__all__ = ["Compressor", "Done", "OneBit", "PowerSGD", "Span", "build"]

_METHODS: dict[str, Any] = {
    "powersgd": lambda cfg: PowerSGD(cfg.rank, cfg.warmup_steps),
    "onebit": lambda cfg: OneBit(cfg.warmup_steps),
}


def build(cfg: Any) -> Compressor | None:
    """The compressor ``cfg`` (a ``CompressionConfig``) asks for; None for exact reductions."""
    if cfg is None or cfg.method == "none":
        return None
    return _METHODS[cfg.method](cfg)
