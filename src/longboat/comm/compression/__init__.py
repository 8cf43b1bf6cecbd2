"""Gradient compression for the data-parallel reduction of ``replicate`` and ``zero``
(docs/compression.md): one method per file behind :class:`Compressor`
([Note: compressed reduction] in ``protocol.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from longboat.comm.compression.onebit import OneBit
from longboat.comm.compression.powersgd import PowerSGD
from longboat.comm.compression.protocol import Compressor, Span
from longboat.comm.protocol import Done

__all__ = ["Compressor", "Done", "OneBit", "PowerSGD", "Span", "build"]


class _Settings(Protocol):
    """What :func:`build` reads of a ``CompressionConfig``."""

    @property
    def method(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def warmup_steps(self) -> int: ...


_METHODS: dict[str, Callable[[_Settings], Compressor]] = {
    "powersgd": lambda cfg: PowerSGD(cfg.rank, cfg.warmup_steps),
    "onebit": lambda cfg: OneBit(cfg.warmup_steps),
}


def build(cfg: _Settings | None) -> Compressor | None:
    """The compressor ``cfg`` (a ``CompressionConfig``) asks for; None for exact reductions."""
    if cfg is None or cfg.method == "none":
        return None
    return _METHODS[cfg.method](cfg)
