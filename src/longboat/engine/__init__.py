"""The engine: a model trained by a strategy (:class:`Engine`, in ``core``), the methods it runs
between steps (``state``), and how one is built (:func:`initialize`, in ``assembly``)."""

from __future__ import annotations

from longboat.engine.assembly import (
    assemble,
    initialize,
    resolve_mesh,
    seed_everything,
    serve_beside,
)
from longboat.engine.core import Engine

__all__ = [
    "Engine",
    "assemble",
    "initialize",
    "resolve_mesh",
    "seed_everything",
    "serve_beside",
]
